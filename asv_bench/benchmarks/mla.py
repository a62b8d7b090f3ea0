"""asv benchmarks of numattn.mla_decode on the GPU (skipped without one): median GPU microseconds
from CUDA events, and FlashInfer's GB/s metric, on pages of one latent row."""

import numattn
from numattn.bench import MLA_SHAPES, cuda_time_ms


class MlaDecode:
    params = (MLA_SHAPES,)
    param_names = ["batch_heads_seqlen"]

    def setup(self, shape):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        batch, heads, seqlen = shape
        self.args = (
            torch.randn(batch, heads, 512, device="cuda", dtype=torch.float16),
            torch.randn(batch, heads, 64, device="cuda", dtype=torch.float16),
            torch.randn(batch * seqlen, 1, 512, device="cuda", dtype=torch.float16),
            torch.randn(batch * seqlen, 1, 64, device="cuda", dtype=torch.float16),
            torch.arange(batch * seqlen, device="cuda", dtype=torch.int32).reshape(batch, seqlen),
            torch.full((batch,), seqlen, device="cuda", dtype=torch.int32),
        )
        self.bytes = 2 * batch * (heads * (512 + 64 + 512) + seqlen * (512 + 64))
        self.call()  # compile outside the timing

    def call(self):
        return numattn.mla_decode(*self.args, scale=0.1, check=False)

    def track_us(self, shape):
        return cuda_time_ms(self.call) * 1e3

    def track_gbs(self, shape):
        return self.bytes / cuda_time_ms(self.call) / 1e6

    track_us.unit = "us"
    track_gbs.unit = "GB/s"
