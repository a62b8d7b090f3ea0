"""Input construction and comparison shared by the tests."""

import contextlib

import numpy as np

from numattn import reference

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # numpy has no bfloat16; tests build bf16 through torch instead
    BF16 = None


def random_qkv(rng, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v=None, layout="bhsd"):
    """Float32 numpy q, k, v with unit-variance entries in ``layout``."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    shapes = [
        (batch, heads_q, seqlen_q, head_dim),
        (batch, heads_kv, seqlen_kv, head_dim),
        (batch, heads_kv, seqlen_kv, head_dim_v),
    ]
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    if layout == "bshd":
        arrays = [np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in arrays]
    return arrays


def as_dtype(arrays, dtype, library="numpy"):
    """Cast float32 numpy arrays to ``dtype`` in ``library`` ("numpy" or "torch")."""
    if library == "torch" or dtype == "bfloat16":
        import torch

        return [torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays]
    return [a.astype(dtype) for a in arrays]


MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23}


def max_error(actual, expected, rounded_to=None):
    """Largest absolute difference of ``actual`` from the float64 ``expected``. With ``rounded_to`` (a
    dtype name), each difference less half a unit in the last place of the expected value in that
    dtype: the rounding of the output itself, which no kernel writing that dtype avoids (in bf16,
    0.0156 for values in [4, 8))."""
    actual = reference.to_float64(actual)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "non-finite values in the output"
    error = np.abs(actual - expected)
    if rounded_to is not None:
        _, exponent = np.frexp(expected)  # |expected| in [2^(exponent-1), 2^exponent); 0 is exact
        error -= np.where(expected != 0, np.ldexp(0.5, exponent - 1 - MANTISSA_BITS[rounded_to]), 0.0)
    return float(error.max())


def torch_attention(q, k, v, causal, window, softcap, alibi_slopes, sinks):
    """The attention with the options computed by torch in the inputs' dtype (scores, softcap, ALiBi's bias
    and P rounded to it; the bias computed in at least float32): in float64 the reference of the
    gradients, in 16 bits the error of an ordinary low-precision implementation, which flash-attn's tests
    allow twice of."""
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    sq, sk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.promote_types(q.dtype, torch.float32))
        scores = scores - (slopes[..., None, None] * (i - j).abs()).to(q.dtype)
    left, right = window or (-1, -1)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal or right not in (None, -1):
        visible &= j <= i + (0 if causal else right)
    if left not in (None, -1):
        visible &= j >= i - left
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # a column with no value row
        sink_column = sinks.to(q.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num()
    return p[..., :sk] @ v


def low_precision_allowance(q, k, v, ref_o, options):
    """flash-attn's allowance: twice the error of the same attention computed by torch in the inputs' dtype,
    and an ulp of the output."""
    import torch

    q, k, v = (x if isinstance(x, torch.Tensor) else torch.from_numpy(x) for x in (q, k, v))
    slopes, sinks = (None if options.get(name) is None else torch.as_tensor(options[name])
                     for name in ("alibi_slopes", "sinks"))
    low = torch_attention(q, k, v, options.get("causal", False), options.get("window"), options.get("softcap"),
                          slopes, sinks)
    return 2 * max_error(low.float(), ref_o) + float(torch.finfo(q.dtype).eps) * np.abs(ref_o).max()


class OnlyDLPack:
    """An array that speaks DLPack and nothing else (as some libraries' arrays do)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@contextlib.contextmanager
def on_busy_side_stream(torch):
    """Run the block on a new CUDA stream (after the current stream's queued work) that is kept busy by
    large matrix products queued first: work on the wrong stream, or reading data before its copy on this
    one, races and shows."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64
        yield stream
