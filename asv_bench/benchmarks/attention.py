"""asv benchmarks of numattn.attention on the GPU (skipped on machines without one).

``track_*`` report the median GPU milliseconds from CUDA events and ``time_*``
the host time of one call, so that both kernel speed and launch overhead are
tracked across commits. Each class compares with torch SDPA in the same run.
"""

import numattn
from numattn.bench import cuda_time_ms


def _cuda_torch():
    if numattn.SIMULATOR:
        raise NotImplementedError("needs an NVIDIA GPU")
    import torch

    return torch


VARIANTS = ["causal", "window 1024", "softcap 30", "alibi", "sinks"]


def variant_options(variant, per_head):
    """The score-modification arguments of ``variant`` (one of ``VARIANTS``; every one causal), with the
    float32 ``per_head`` values (``[heads]``) as ALiBi's slopes (scaled by 0.1) or the sinks' logits."""
    return {"causal": {}, "window 1024": {"window": (1024, 0)}, "softcap 30": {"softcap": 30.0},
            "alibi": {"alibi_slopes": per_head * 0.1}, "sinks": {"sinks": per_head}}[variant]


class AttentionForward:
    # the last two shapes are the tensor-core targets W5 and W4
    params = (
        [(4, 16, 1024, 64), (2, 16, 2048, 128), (8, 16, 2048, 64), (4, 32, 4096, 128)],
        ["float16", "bfloat16", "float32"],
        [False, True],
    )
    param_names = ["shape", "dtype", "causal"]
    unit = "ms"

    def setup(self, shape, dtype, causal):
        torch = _cuda_torch()
        self.q, self.k, self.v = (torch.randn(*shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
        numattn.attention(self.q, self.k, self.v, causal=causal)  # compile outside the timing

    def track_numattn_ms(self, shape, dtype, causal):
        return cuda_time_ms(lambda: numattn.attention(self.q, self.k, self.v, causal=causal))

    def track_sdpa_ms(self, shape, dtype, causal):
        import torch

        return cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=causal)
        )

    track_numattn_ms.unit = track_sdpa_ms.unit = "ms"


class AttentionVariants:
    """Causal bf16 attention with each score modification (``benchmarks/variants.py`` compares them with
    FlexAttention): the cost of each against plain causal attention."""

    params = (VARIANTS,)
    param_names = ["variant"]
    unit = "ms"

    def setup(self, variant):
        torch = _cuda_torch()
        self.q, self.k, self.v = (torch.randn(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        self.options = variant_options(variant, torch.rand(16, device="cuda", dtype=torch.float32))
        numattn.attention(self.q, self.k, self.v, causal=True, **self.options)  # compile outside the timing

    def track_numattn_ms(self, variant):
        return cuda_time_ms(lambda: numattn.attention(self.q, self.k, self.v, causal=True, **self.options))

    track_numattn_ms.unit = "ms"



class AttentionShortGrid:
    """Few query tiles over many keys (a chunk of queries against a long context, few heads), not causal:
    the default splits the keys among more blocks on sm_90. Against SDPA's default backend."""

    params = ([(1, 8, 512, 16384, 128), (1, 16, 256, 32768, 64)],)
    param_names = ["shape (B, H, Lq, Lkv, D)"]
    unit = "ms"

    def setup(self, shape):
        torch = _cuda_torch()
        batch, heads, seqlen_q, seqlen_kv, head_dim = shape
        dtype = torch.bfloat16 if head_dim == 128 else torch.float16
        self.q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype)
        self.k, self.v = (torch.randn(batch, heads, seqlen_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        numattn.attention(self.q, self.k, self.v)  # compile outside the timing

    def track_numattn_ms(self, shape):
        return cuda_time_ms(lambda: numattn.attention(self.q, self.k, self.v))

    def track_sdpa_ms(self, shape):
        import torch

        return cuda_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(self.q, self.k, self.v))

    track_numattn_ms.unit = track_sdpa_ms.unit = "ms"

class AttentionVarlen:
    """``attention_varlen`` on packed sequences of one length (causal; bf16 at head dim 128, fp16 at 64), keys
    packed or in shuffled pages of 16, against the padded batch (``benchmarks/varlen.py`` compares them): B8
    L2048 Hq32 Hkv8, and a chunked prefill of few query tiles (B4 H8, 256 queries over 16384 keys), whose keys
    the default splits among more blocks on sm_90."""

    params = ([(8, 32, 8, 2048, 2048, 128), (8, 32, 8, 2048, 2048, 64), (4, 8, 8, 256, 16384, 128)],
              ["padded batch", "packed", "paged 16"])
    param_names = ["shape (B, Hq, Hkv, Lq, Lkv, D)", "layout"]
    unit = "ms"

    def setup(self, shape, layout):
        torch = _cuda_torch()
        batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim = shape
        dtype = torch.bfloat16 if head_dim == 128 else torch.float16
        q = torch.randn(batch * seqlen_q, heads_q, head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch * seqlen_kv, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
        cu_q, cu_k = (torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda") for n in (seqlen_q, seqlen_kv))
        if layout == "padded batch":
            padded = [x.view(batch, -1, *x.shape[1:]) for x in (q, k, v)]
            self.call = lambda: numattn.attention(*padded, causal=True, layout="bshd")
        elif layout == "packed":
            self.call = lambda: numattn.attention_varlen(q, k, v, cu_q, cu_k, seqlen_q, seqlen_kv, causal=True)
        else:
            pages = torch.randperm(batch * seqlen_kv // 16, device="cuda").to(torch.int32)
            k_pages, v_pages = (torch.empty(len(pages), 16, heads_kv, head_dim, device="cuda", dtype=dtype)
                                for _ in range(2))
            k_pages[pages.long()], v_pages[pages.long()] = (x.view(-1, 16, heads_kv, head_dim) for x in (k, v))
            table, used = pages.view(batch, -1), torch.full((batch,), seqlen_kv, dtype=torch.int32, device="cuda")
            self.call = lambda: numattn.attention_varlen(q, k_pages, v_pages, cu_q, None, seqlen_q, seqlen_kv,
                                                         causal=True, page_table=table, seqused_k=used)
        self.call()  # compile outside the timing

    def track_numattn_ms(self, shape, layout):
        return cuda_time_ms(self.call)

    track_numattn_ms.unit = "ms"


class LaunchOverhead:
    """Host time of one call on tiny inputs: the launcher's overhead."""

    def setup(self):
        torch = _cuda_torch()
        self.q, self.k, self.v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        numattn.attention(self.q, self.k, self.v)

    def time_attention_tiny(self):
        numattn.attention(self.q, self.k, self.v)


if __name__ == "__main__":  # run without asv: python asv_bench/benchmarks/attention.py
    import itertools
    import timeit

    bench = AttentionForward()
    for params in itertools.product(*AttentionForward.params):
        bench.setup(*params)
        print(params, f"numattn {bench.track_numattn_ms(*params):.3f} ms, sdpa {bench.track_sdpa_ms(*params):.3f} ms")
    overhead = LaunchOverhead()
    overhead.setup()
    print(f"tiny call: {min(timeit.repeat(overhead.time_attention_tiny, number=200, repeat=20)) / 200 * 1e6:.1f} µs")
