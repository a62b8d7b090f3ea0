"""Bad input to numattn.attention raises a clear error naming the argument, before any launch."""

import numpy as np
import pytest
import torch

import numattn

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
