"""numattn.torch: the attention autograd function (backward kernels) and the GQA module."""

import pytest

torch = pytest.importorskip("torch")

import numattn  # noqa: E402
import numattn.torch as nt  # noqa: E402
from numattn.configs.backward import BackwardWgmmaConfig  # noqa: E402

from helpers import on_busy_side_stream  # noqa: E402

GRAD_ATOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def reference_attention(q, k, v, causal, scale):
    """float64 softmax attention with GQA by repetition and bottom-right causal masking; a row that sees
    no key gives 0 (as numattn's forward)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def check_gradients(q, k, v, causal, output_gradient=torch.randn_like):
    """numattn's gradients against float64 autograd of the reference, for every input that requires one;
    ``output_gradient(o)`` makes the gradient of the output."""
    scale = 0.7 / q.shape[-1] ** 0.5
    o = nt.attention(q, k, v, causal=causal, scale=scale)
    do = output_gradient(o)
    o.backward(do)
    exact = [x.detach().double().requires_grad_(x.requires_grad) for x in (q, k, v)]
    ref = reference_attention(*exact, causal, scale)
    ref.backward(do.double())
    assert (o.double() - ref).abs().max().item() <= GRAD_ATOL[q.dtype]
    for x, e in zip((q, k, v), exact, strict=True):
        if x.requires_grad:
            assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
            err = (x.grad.double() - e.grad).abs().max().item()
            assert err <= GRAD_ATOL[q.dtype] * max(1.0, e.grad.abs().max().item()), err
        else:
            assert x.grad is None


def leaf(shape, dtype, device="cpu", requires_grad=True):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 4, 2, 7, 11, 16), (2, 2, 1, 9, 5, 16)])  # GQA, MQA; Sq > Skv masks rows
def test_gradients_match_float64(causal, shape):
    batch, hq, hkv, sq, skv, d = shape
    q, k, v = leaf((batch, hq, sq, d), torch.float32), leaf((batch, hkv, skv, d), torch.float32), leaf(
        (batch, hkv, skv, d), torch.float32)
    check_gradients(q, k, v, causal)


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck's note that the inputs are not float64
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    """torch.autograd.gradcheck of the autograd function: its backward against finite differences of its
    own forward, every Jacobian entry. The kernels take no float64, so float32 with a step and tolerances
    to match (they catch gradients 1% off)."""
    torch.manual_seed(0)
    q, k, v = leaf((1, 2, 3, 8), torch.float32), leaf((1, 1, 5, 8), torch.float32), leaf((1, 1, 5, 8), torch.float32)
    assert torch.autograd.gradcheck(lambda q, k, v: nt.attention(q, k, v, causal=causal), (q, k, v), eps=1e-2,
                                    atol=5e-4, rtol=5e-3)


def test_gradients_for_a_subset_non_contiguous_inputs_and_no_grad():
    # (batch, seq, heads, dim) leaves seen as (batch, heads, seq, dim): strided views; q wants no gradient
    k_leaf, v_leaf = torch.randn(1, 9, 2, 16, requires_grad=True), torch.randn(1, 9, 2, 16, requires_grad=True)
    q = torch.randn(1, 6, 4, 16).transpose(1, 2)
    o = nt.attention(q, k_leaf.transpose(1, 2), v_leaf.transpose(1, 2), causal=True, scale=0.3)
    do = torch.randn_like(o)
    o.backward(do)
    k64, v64 = (x.detach().double().requires_grad_() for x in (k_leaf, v_leaf))
    reference_attention(q.double(), k64.transpose(1, 2), v64.transpose(1, 2), True, 0.3).backward(do.double())
    for x, e in ((k_leaf, k64), (v_leaf, v64)):
        assert (x.grad.double() - e.grad).abs().max().item() <= 2e-4
    with torch.no_grad():
        o = nt.attention(q, k_leaf.transpose(1, 2), v_leaf.transpose(1, 2))
    assert not o.requires_grad
    ref = reference_attention(q.double(), k64.detach().transpose(1, 2), v64.detach().transpose(1, 2), False, 0.25)
    assert (o.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype, causal, seqlens", [
    (torch.float16, False, (37, 45)), (torch.bfloat16, True, (37, 45)), (torch.float16, True, (45, 21))])
def test_tensor_core_gradients_over_many_tiles(dtype, causal, seqlens):
    """The tensor-core backward (16-row query tiles, 16-key blocks in the simulator): several query tiles
    per head of a GQA group, partial tiles at both sequence ends, head_dim_v < head_dim, and (causal with
    more queries than keys) rows that see no key."""
    from numattn.ops.backward import backward_config

    assert backward_config(str(dtype).removeprefix("torch."), 32, 16) is not None
    sq, skv = seqlens
    q, k, v = leaf((1, 4, sq, 32), dtype), leaf((1, 2, skv, 32), dtype), leaf((1, 2, skv, 16), dtype)
    check_gradients(q, k, v, causal)


@pytest.mark.parametrize("producer_config", [None, BackwardWgmmaConfig(2, 2, producer=True),
                                             BackwardWgmmaConfig(2, 1, producer=True, stages=3),
                                             BackwardWgmmaConfig(2, 1, producer=True, stages=3, ds_stages=2),
                                             BackwardWgmmaConfig(2, 1, producer=True, stages=3, ds_stages=2,
                                                                 tensor_copies=True)],
                         ids=["computing-warpgroups-copy", "producer", "producer-3-stages", "producer-2-ds-buffers",
                              "tensor-copies"])
def test_warpgroup_gradients(producer_config, monkeypatch, fresh_plans):
    """The wgmma backward (sm_90, head dims multiples of 64; the simulator reports sm_90): a GQA group,
    query tiles enough to go round the stages, two key blocks, causal with partial tiles; the default
    configuration at head dim 64, and two warpgroups beside a producer at head dim 128, with two stages of
    query tiles and two dQ buffers or three and one, with two dS buffers, and with Q and dO by tensor copies."""
    import numattn.ops.backward
    from numattn.ops.backward import backward_config

    assert isinstance(backward_config("bfloat16", 64, 64), BackwardWgmmaConfig)
    head_dim, seqlen_kv = (128, 150) if producer_config else (64, 100)
    if producer_config:
        monkeypatch.setattr(numattn.ops.backward, "choose_backward_wgmma_config", lambda *_: producer_config)
    q = leaf((1, 2, 200 if producer_config else 70, head_dim), torch.bfloat16)
    k, v = leaf((1, 1, seqlen_kv, head_dim), torch.bfloat16), leaf((1, 1, seqlen_kv, head_dim), torch.bfloat16)
    check_gradients(q, k, v, causal=True)


def test_backward_producer_where_it_fits():
    """At head dim 128 the wgmma backward's default has a producer warpgroup, three query stages, two dS
    buffers and tensor copies (with every score modification and packed sequences alike); other head dims have
    one warpgroup and no producer."""
    from numattn.configs.backward import choose_backward_wgmma_config

    assert choose_backward_wgmma_config(128, 128, 227 * 1024) == BackwardWgmmaConfig(2, 1, producer=True, stages=3,
                                                                                     ds_stages=2, tensor_copies=True)
    assert not choose_backward_wgmma_config(64, 64, 227 * 1024).producer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_in_16_bit(dtype):
    check_gradients(leaf((1, 2, 8, 16), dtype), leaf((1, 1, 8, 16), dtype), leaf((1, 1, 8, 16), dtype), causal=True)


@pytest.mark.parametrize("head_dim", [16, 12])  # rows read in 16-byte chunks, and element by element
def test_output_gradient_rows_neither_aligned_nor_contiguous(head_dim):
    """dO's rows reach the backward 2 bytes past a 16-byte boundary, one element into rows of D + 1 (on the
    GPU where there is one: a misaligned 16-byte load would fault)."""
    def misaligned(o):
        wide = torch.randn(*o.shape[:-1], o.shape[-1] + 1, dtype=o.dtype, device=o.device)
        return wide[..., 1:]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (leaf((1, 2, 9, head_dim), torch.bfloat16, device) for _ in range(3))
    check_gradients(q, k, v, causal=True, output_gradient=misaligned)


def test_grouped_query_attention_module_matches_sdpa():
    torch.manual_seed(0)
    layer = nt.GroupedQueryAttention(dim=32, heads=4, kv_heads=2, causal=True)
    x = torch.randn(2, 7, 32, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x2 = x.detach().requires_grad_()
    b, s, _ = x2.shape
    q = layer.q_proj(x2).view(b, s, 4, 8).transpose(1, 2)
    k = layer.k_proj(x2).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    v = layer.v_proj(x2).view(b, s, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    y2 = layer.out_proj(o.transpose(1, 2).reshape(b, s, 32))
    y2.square().sum().backward()
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-4)
    for g, p in zip(grads, [*layer.parameters(), x2], strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-3)
    with pytest.raises(ValueError, match="multiple of heads"):
        nt.GroupedQueryAttention(dim=30, heads=4, kv_heads=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, causal", [
    (torch.float32, 64, True),  # CUDA cores
    (torch.bfloat16, 64, True), (torch.float16, 128, False),  # wgmma on sm_90, mma.sync elsewhere
    (torch.bfloat16, 96, True),  # mma.sync
])
def test_gradients_on_gpu(dtype, head_dim, causal):
    q, k, v = (leaf(s, dtype, "cuda") for s in [(2, 8, 170, head_dim), (2, 2, 290, head_dim), (2, 2, 290, head_dim)])
    check_gradients(q, k, v, causal)


@pytest.mark.gpu
def test_backward_tensor_maps_are_encoded_once_for_recurring_tensors(monkeypatch):
    """The wgmma backward's tensor maps of Q and dO (head dim 128 on sm_90) are encoded once for tensors at
    the same addresses, and again for a step on a busy side stream, which reads its own upload: every
    step's gradients match float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor copies need sm_90")
    from numattn.ops import backward as backward_ops

    caches = []  # the backward's caches of tensor maps, one per layout

    class Recorded(backward_ops.TensorMapCache):
        def __init__(self, *args):
            super().__init__(*args)
            caches.append(self)

    monkeypatch.setattr(backward_ops, "TensorMapCache", Recorded)
    backward_ops._tensor_maps.cache_clear()
    q, k, v = (leaf((1, 4, 300, 128), torch.bfloat16, "cuda") for _ in range(3))
    do = torch.empty(q.shape, dtype=q.dtype, device="cuda")  # one buffer for every step's output gradient
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        check_gradients(q, k, v, causal=True, output_gradient=lambda o: do.copy_(torch.randn_like(o)))
    assert [len(cache.entries) for cache in caches] == [1]  # encoded in the first step
    with on_busy_side_stream(torch):  # maps read before their copy would show
        for x in (q, k, v):
            x.grad = None
        check_gradients(q, k, v, causal=True, output_gradient=lambda o: do.copy_(torch.randn_like(o)))
    assert [len(cache.entries) for cache in caches] == [2]


def test_example_transformer_trains_like_the_sdpa_model():
    """examples/gqa_transformer.py: two steps of the tiny model with numattn and with SDPA, same weights
    and batches, give the same losses."""
    import copy
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "gqa_transformer.py"
    spec = importlib.util.spec_from_file_location("gqa_transformer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    size = dict(num_tokens=16, max_seq_len=16, dim=32, depth=1, heads=4, kv_heads=2)
    torch.manual_seed(0)
    ours = example.GQATransformer(**size)
    theirs = example.GQATransformer(**size, attention_class=example.SdpaGroupedQueryAttention)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    runs = [example.train(m, 2, 2, 6, 16, 1e-3, 0, torch.device("cpu"), torch.float32) for m in (ours, theirs)]
    assert runs[0] == pytest.approx(runs[1], rel=1e-4)


def test_backward_kernel_specs_type_the_tensors_it_launches_on(monkeypatch):
    """The argument types a backward kernel is compiled ahead for (``_backward_specs``) are those of the
    tensors the backward then launches it on, on tensor cores and on CUDA cores: otherwise the kernel
    compiled ahead would sit in the cache under another key."""
    import numba
    from numba import types

    from numattn._arrays import storage_dtype
    from numattn.ops import backward as backward_module

    launched = []
    launch = backward_module._launch

    def recording(spec, grid, threads, shared_bytes, arrays, scalars, stream, mods=None, offsets=(), prepared=None):
        launched.append((spec, arrays, scalars, mods or ((), ()), offsets))
        launch(spec, grid, threads, shared_bytes, arrays, scalars, stream, mods, offsets, prepared)

    def typed(tensors):
        return tuple(types.Array(numba.from_dtype(storage_dtype(str(x.dtype).removeprefix("torch."))), x.dim(), "A")
                     for x in tensors)

    monkeypatch.setattr(backward_module, "_launch", recording)
    device = "cpu" if numattn.SIMULATOR else "cuda"  # host tensors run the kernels in the simulator
    for dtype, head_dim in ((torch.float16, 16), (torch.float32, 16)):  # tensor cores, CUDA cores
        q, k, v = (leaf(s, dtype, device) for s in [(1, 2, 5, head_dim), (1, 1, 7, head_dim), (1, 1, 7, head_dim)])
        nt.attention(q, k, v, causal=True).sum().backward()
        nt.attention(q, k, v, causal=True, window=(2, 0), alibi_slopes=torch.ones(2, device=device)).sum().backward()
        packed = [leaf((7, 2, head_dim), dtype, device), leaf((9, 1, head_dim), dtype, device),
                  leaf((9, 1, head_dim), dtype, device)]
        cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 3, 7], [0, 4, 9]))
        nt.attention_varlen(*packed, cu_q, cu_k, 4, 5, causal=True).sum().backward()
    assert {spec.args[0] for spec, *_ in launched} == {"rows", "tiles", "dq", "dkdv"}
    assert any(offsets for *_, offsets in launched)
    for spec, arrays, scalars, (mod_arrays, mod_scalars), offsets in launched:
        mod_types = tuple(types.int64 if isinstance(x, int) else types.float32 for x in mod_scalars)
        assert spec.argtypes == (typed(arrays) + (types.float32,) * len(scalars) + typed(mod_arrays) + mod_types
                                 + tuple(types.Array(types.int32, 1, "A") for _ in offsets)), spec.label


@pytest.mark.gpu
def test_backward_kernels_compiled_ahead_are_the_ones_the_backward_loads(tmp_path, monkeypatch):
    """A worker process compiles a backward's kernels into an empty cache; the backward then loads both
    from there and compiles nothing itself."""
    from numattn.kernels import compile_ahead, launch
    from numattn.ops import backward as backward_module

    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", str(tmp_path))
    config = backward_module.backward_config("bfloat16", 128, 128, 0)
    specs = backward_module._backward_specs("bfloat16", 128, 128, True, config)
    worker = compile_ahead.compile_ahead(specs.values(), 0)
    assert worker is not None and worker.wait(timeout=600) == 0
    assert compile_ahead.compile_ahead(specs.values(), 0) is None  # all cached now
    compiled_here = []
    compile_in_process = launch._compile
    monkeypatch.setattr(launch, "_compile", lambda d, a, label: compiled_here.append(label) or compile_in_process(d, a, label))
    q, k, v = (leaf(s, torch.bfloat16, "cuda") for s in [(1, 4, 130, 128), (1, 2, 200, 128), (1, 2, 200, 128)])
    check_gradients(q, k, v, True)
    assert not [label for label in compiled_here if label.startswith("backward")], compiled_here
