"""Bad input to numattn.attention raises a clear error naming the argument, before any launch."""

import numpy as np
import pytest
import torch

import numattn
import numattn.torch as numattn_torch

pytestmark = pytest.mark.sim


def qkv(q_shape=(1, 2, 4, 16), kv_shape=(1, 2, 5, 16), v_shape=None, dtype=np.float32):
    q = np.ones(q_shape, dtype=dtype)
    k = np.ones(kv_shape, dtype=dtype)
    v = np.ones(v_shape or kv_shape, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 4, 16), (1, 2, 5, 16)), r"q must be 4-D .* got shape \(2, 4, 16\)"),
        (((1, 2, 4, 16), (1, 2, 1, 5, 16)), r"k must be 4-D"),
        (((1, 2, 4, 16), (2, 2, 5, 16)), r"same batch size, got 1, 2 and 2"),
        (((1, 2, 4, 16), (1, 2, 5, 8)), r"k head_dim must equal q head_dim 16, got 8"),
        (((1, 3, 4, 16), (1, 2, 5, 16)), r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (((1, 2, 0, 16), (1, 2, 5, 16)), r"q has a zero-size dimension"),
        (((1, 2, 4, 16), (1, 2, 0, 16)), r"k has a zero-size dimension"),
        (((1, 2, 4, 272), (1, 2, 5, 272)), r"head_dim must be at most 256, got 272"),
    ],
)
def test_shape_errors(shapes, message):
    q, k, v = qkv(*shapes)
    with pytest.raises(ValueError, match=message):
        numattn.attention(q, k, v)


def test_k_v_mismatch():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=r"k and v must have the same sequence length, got 5 and 6"):
        numattn.attention(q, k, np.ones((1, 2, 6, 16), np.float32))
    with pytest.raises(ValueError, match=r"k and v must have the same number of heads, got 2 and 1"):
        numattn.attention(q, k, np.ones((1, 1, 5, 16), np.float32))
    with pytest.raises(ValueError, match=r"v head_dim must be at most 256, got 300"):
        numattn.attention(q, k, np.ones((1, 2, 5, 300), np.float32))


def test_dtype_errors():
    q, k, v = qkv(dtype=np.float64)
    with pytest.raises(TypeError, match=r"q has dtype float64; expected float16, bfloat16 or float32"):
        numattn.attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"one dtype, got q float32, k float16, v float32"):
        numattn.attention(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match=r"v has dtype int32"):
        numattn.attention(q, k, v.astype(np.int32))


def test_not_arrays():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k must be an array .* got list"):
        numattn.attention(q, k.tolist(), v)


def test_flags_and_scale():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"layout must be 'bhsd' or 'bshd', got 'bsh'"):
        numattn.attention(q, k, v, layout="bsh")
    with pytest.raises(TypeError, match=r"causal must be a bool, got int"):
        numattn.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got str"):
        numattn.attention(q, k, v, return_lse="yes")
    with pytest.raises(TypeError, match=r"scale must be a real number or None, got str"):
        numattn.attention(q, k, v, scale="0.1")
    with pytest.raises(TypeError, match=r"scale must be a real number or None, got list"):
        numattn.attention(q, k, v, scale=[0.1])
    with pytest.raises(ValueError, match=r"scale must be finite, got nan"):
        numattn.attention(q, k, v, scale=float("nan"))


def test_cached_plan_does_not_bypass_validation(rng):
    q, k, v = (rng.standard_normal((1, 1, 3, 16), dtype=np.float32) for _ in range(3))
    numattn.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        numattn.attention(q, k, v, causal=1)


def test_out_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"out must have shape \(1, 2, 4, 16\), got \(1, 2, 4, 8\)"):
        numattn.attention(q, k, v, out=np.empty((1, 2, 4, 8), np.float32))
    with pytest.raises(TypeError, match=r"out must have dtype float32 like q, got float16"):
        numattn.attention(q, k, v, out=np.empty((1, 2, 4, 16), np.float16))
    q, k, v = qkv((1, 4, 2, 16), (1, 5, 2, 16))  # bshd: 4 queries, 5 keys, 2 heads
    with pytest.raises(ValueError, match=r"out must have shape \(1, 4, 2, 16\), got \(1, 2, 4, 16\)"):
        numattn.attention(q, k, v, layout="bshd", out=np.empty((1, 2, 4, 16), np.float32))


def test_devices_differ():
    from numba import cuda

    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"one device, got q on host memory, k on GPU 0, v on host memory"):
        numattn.attention(q, cuda.to_device(k), v)


def test_unsupported_torch_device():
    q, k, v = (torch.ones(1, 1, 2, 16, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match=r"q is on torch device meta"):
        numattn.attention(q, k, v)


def test_non_native_byte_order_is_refused(rng):
    q, k, v = (rng.standard_normal((1, 2, 4, 16), dtype=np.float32) for _ in range(3))
    swapped = k.astype(">f4")
    with pytest.raises(TypeError, match=r"k has non-native byte order \('>f4'\)"):
        numattn.attention(q, swapped, v)
    with pytest.raises(TypeError, match=r"k_cache has non-native byte order \('>f2'\)"):
        numattn.decode(q[:, :, 0].astype(np.float16), k.astype(">f2"), v.astype(np.float16))
    o, lse = rng.standard_normal((3, 16), dtype=np.float32), rng.standard_normal(3, dtype=np.float32)
    with pytest.raises(TypeError, match=r"lse_b has non-native byte order"):
        numattn.merge_states(o, lse, o, lse.astype(">f4"))
    with pytest.raises(TypeError, match=r"seqlens has non-native byte order \('>i4'\)"):
        numattn.decode(q[:, :, 0], k, v, seqlens=np.array([3], ">i4"))


def test_tensors_requiring_grad_point_to_the_autograd_function(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 4, 16), dtype=np.float32)) for _ in range(3))
    k.requires_grad_()
    with pytest.raises(ValueError, match=r"requires grad.*numattn\.torch\.attention"):
        numattn.attention(q, k, v)
    with torch.no_grad():
        assert numattn.attention(q, k, v).shape == (1, 2, 4, 16)


def test_the_autograd_functions_name_their_bad_arguments(rng):
    """``numattn.torch``: slopes and sinks must be torch tensors (a numpy array was refused by torch's own
    saving for the backward, naming nothing); a q of the wrong rank is named as such, gradients or not;
    ``GroupedQueryAttention`` takes numpy bools as the functions do."""
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 4, 16), dtype=np.float32)).requires_grad_()
               for _ in range(3))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor, got ndarray"):
        numattn_torch.attention(q, k, v, sinks=np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor, got ndarray"):
        numattn_torch.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                       torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                                       4, 4, alibi_slopes=np.ones(2, np.float32))
    for shape in ((16,), (4, 2, 16)):
        with pytest.raises(ValueError, match="q must be 4-D"):
            numattn_torch.attention(torch.ones(shape, requires_grad=True), k, v, alibi_slopes=torch.ones(2))
    assert numattn_torch.GroupedQueryAttention(32, 4, 2, causal=np.bool_(True)).causal is True


def test_no_op_drops_a_gradient_silently(rng):
    """Sinks that require grad (the one option with a gradient) are refused like q, k and v; so are tensors
    requiring grad in the decode functions and plans, which are for inference."""
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 4, 16), dtype=np.float32)) for _ in range(3))
    sinks = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"sinks requires grad.*numattn\.torch\.attention"):
        numattn.attention(q, k, v, sinks=sinks)
    query = q[:, :, 0].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"numattn\.decode records no gradients"):
        numattn.decode(query, k, v)
    plan = numattn.decode_plan(query.detach(), k, v)
    with pytest.raises(ValueError, match=r"numattn\.decode records no gradients"):
        plan(query)
    with torch.no_grad():
        assert numattn.attention(q, k, v, sinks=sinks).shape == (1, 2, 4, 16)
        assert numattn.decode(query, k, v).shape == (1, 2, 16)
        assert plan(query).shape == (1, 2, 16)


def test_out_must_be_writable_and_not_overlap(rng):
    q, k, v = (rng.standard_normal((1, 2, 4, 16), dtype=np.float32) for _ in range(3))
    read_only = np.empty((1, 2, 4, 16), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be writable"):
        numattn.attention(q, k, v, out=read_only)
    row = np.empty(16, np.float32)
    overlapping = np.lib.stride_tricks.as_strided(row, (1, 2, 4, 16), (0, 0, 0, 4))
    with pytest.raises(ValueError, match=r"out must not overlap itself"):
        numattn.attention(q, k, v, out=overlapping)
    half_overlap = np.lib.stride_tricks.as_strided(np.empty(200, np.float32), (1, 2, 4, 16), (0, 256, 32, 4))
    with pytest.raises(ValueError, match=r"out must not overlap itself"):
        numattn.attention(q, k, v, out=half_overlap)


@pytest.mark.parametrize("scale, error, message", [
    (1e39, ValueError, r"scale must have magnitude at most"),
    (-1e39, ValueError, r"scale must have magnitude at most"),
    (2**1100, ValueError, r"scale must be finite"),
])
def test_scale_out_of_float32_range(scale, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        numattn.attention(q, k, v, scale=scale)


def test_option_of_the_wrong_type_names_the_option():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"layout must be a str, one of 'bhsd', 'bshd'; got list"):
        numattn.attention(q, k, v, layout=["bhsd"])
    with pytest.raises(TypeError, match=r"layout must be a str"):
        numattn.decode(q[:, :, 0], k, v, layout=["bhsd"])
    with pytest.raises(TypeError, match=r"new_input: dims must be a sequence of ints"):
        numattn.new_kernel_graph().new_input((1, 4.5, 16))


def test_torch_attention_validates_like_attention():
    import numattn.torch as nt

    q, k, v = (torch.randn(1, 2, 4, 16) for _ in range(3))
    with pytest.raises(TypeError, match=r"causal must be a bool, got str"):
        nt.attention(q, k, v, causal="no")
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got ndarray"):
        nt.attention(q.numpy(), k, v)
    empty = torch.randn(1, 2, 4, 0)
    with pytest.raises(ValueError, match=r"q has a zero-size dimension"):
        nt.attention(empty, empty, empty)
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        nt.attention(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(ValueError, match=r"kv_heads must be positive, got 0"):
        nt.GroupedQueryAttention(64, 4, 0)
    with pytest.raises(ValueError, match=r"heads must be positive, got 0"):
        nt.GroupedQueryAttention(64, 0, 1)
    module = nt.GroupedQueryAttention(64, 4, 2)
    with pytest.raises(ValueError, match=r"x must be \[batch, seqlen, dim\] with dim 64, got shape \(3, 64\)"):
        module(torch.randn(3, 64))


def test_tune_names_its_arguments(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q, k, v = (rng.standard_normal((1, 1, 8, 16), dtype=np.float32) for _ in range(3))
    with pytest.raises(TypeError, match=r"tune\(attention, \.\.\.\): got an unexpected keyword argument 'check'"):
        numattn.tune(q, k, v, check=False)
    table = numattn.tune(q, k, v, return_lse=True)
    assert any(row["verified"] for row in table)


@pytest.mark.parametrize("typestr, dtype", [("<f2", "float16"), ("<f4", "float32"), ("<i4", "int32"), ("<i8", "int64")])
def test_cuda_array_interface_dtypes_are_named(typestr, dtype, monkeypatch):
    """A device array known only by its ``__cuda_array_interface__`` (CuPy's, say) is described by its dtype's
    name, so that a page table of int32 passes and one of int64 is refused by name."""
    from numattn import _arrays

    monkeypatch.setattr(_arrays, "_cai_device", lambda pointer: 0)  # no driver to ask without a GPU

    class DeviceArray:
        __cuda_array_interface__ = {"shape": (2, 3), "typestr": typestr, "data": (0, False), "version": 3}

    assert _arrays.describe(DeviceArray(), "page_table").dtype == dtype
