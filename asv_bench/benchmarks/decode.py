"""asv benchmarks of numattn.decode and numattn.paged_decode on the GPU (skipped without one).

``track_*`` report median GPU microseconds from CUDA events, next to torch SDPA
(GQA) on the same inputs; ``time_*`` the host time of one call on a tiny cache.
"""

import numattn
from numattn.bench import DECODE_SHAPES, cuda_time_ms, paged_copy


def _cuda_torch():
    if numattn.SIMULATOR:
        raise NotImplementedError("needs an NVIDIA GPU")
    import torch

    return torch


class Decode:
    # the decode targets W1, W2, W3: (batch, heads_q, heads_kv, max_seqlen, head_dim, dtype)
    params = (DECODE_SHAPES, [0, 1, 16, 64])
    param_names = ["shape", "page_size"]  # page_size 0: the contiguous cache

    def setup(self, shape, page_size):
        torch = _cuda_torch()
        batch, heads_q, heads_kv, length, dim, dtype = shape
        tdtype = getattr(torch, dtype)
        self.q = torch.randn(batch, heads_q, dim, device="cuda", dtype=tdtype)
        self.k, self.v = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=tdtype) for _ in range(2))
        self.lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        if page_size:
            self.k_pages, self.v_pages, self.table = paged_copy(torch, self.k, self.v, page_size)
        self.call()  # compile outside the timing

    def call(self):
        if hasattr(self, "table"):
            return numattn.paged_decode(self.q, self.k_pages, self.v_pages, self.table, self.lengths, check=False)
        return numattn.decode(self.q, self.k, self.v, check=False)

    def track_numattn_us(self, shape, page_size):
        return cuda_time_ms(self.call) * 1e3

    def track_sdpa_us(self, shape, page_size):
        import torch

        q4 = self.q.unsqueeze(2)
        return cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q4, self.k, self.v, enable_gqa=True)
        ) * 1e3

    track_numattn_us.unit = track_sdpa_us.unit = "us"


class DecodeLaunchOverhead:
    """Host time of one decode call on a tiny cache, through ``decode`` and through a ``decode_plan``."""

    def setup(self):
        torch = _cuda_torch()
        self.q = torch.randn(1, 8, 128, device="cuda", dtype=torch.float16)
        self.k, self.v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        self.out = torch.empty_like(self.q)
        self.step = numattn.decode_plan(self.q, self.k, self.v)
        numattn.decode(self.q, self.k, self.v, check=False)
        numattn.decode(self.q, self.k, self.v, check=False, out=self.out)

    def time_decode_tiny(self):
        numattn.decode(self.q, self.k, self.v, check=False)

    def time_decode_tiny_into_out(self):
        numattn.decode(self.q, self.k, self.v, check=False, out=self.out)

    def time_decode_plan_tiny(self):
        self.step(self.q)

    def time_decode_plan_tiny_into_out(self):
        self.step(self.q, out=self.out)


class CheckedCalls:
    """The default ``check=True`` against ``check=False`` (median GPU µs per call, L2 flushed): the
    lengths and page indices are checked on the GPU, without a synchronisation."""

    params = (["mla B768 H64 L2048 pages of 1", "mla B768 H16 L1024 pages of 64", "decode(seqlens=) W1",
               "paged_decode W1 pages of 16"], [True, False])
    param_names = ["call", "check"]

    def setup(self, call, check):
        from numattn.bench import checked_calls

        self.call = checked_calls(_cuda_torch())[call]
        self.call(check)  # compile outside the timing

    def track_us(self, call, check):
        return cuda_time_ms(lambda: self.call(check)) * 1e3

    track_us.unit = "us"
