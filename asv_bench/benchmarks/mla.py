"""asv benchmarks of numattn.mla_decode on the GPU (skipped without one): median GPU microseconds
from CUDA events, and FlashInfer's GB/s metric, on pages of one latent row; the default configuration
and the wgmma kernel's shared schedule on its ordinary and its persistent grid (sm_90; the default
runs the persistent one for at most 32 heads, the ordinary one above, where a persistent
configuration also runs the ordinary kernel)."""

import numattn
from numattn.bench import MLA_SHAPES, cuda_time_ms


class MlaDecode:
    params = (MLA_SHAPES, ["default", "ordinary", "persistent"])
    param_names = ["batch_heads_seqlen", "kernel"]

    def setup(self, shape, kernel):
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
        self.call = lambda: numattn.mla_decode(*self.args, scale=0.1, check=False)
        if kernel != "default":
            from numattn.configs.mla import MlaConfig
            from numattn.ops.mla import planned, validate

            if torch.cuda.get_device_capability() != (9, 0):
                raise NotImplementedError("the wgmma kernel needs sm_90")
            config = MlaConfig(32, 4, 8, "shared", True, persistent=kernel == "persistent")
            plan = planned(validate(*self.args, 0.1, False), config)
            self.call = lambda: plan(*self.args)
        self.call()  # compile outside the timing

    def track_us(self, shape, kernel):
        return cuda_time_ms(self.call) * 1e3

    def track_gbs(self, shape, kernel):
        return self.bytes / cuda_time_ms(self.call) / 1e6

    track_us.unit = "us"
    track_gbs.unit = "GB/s"
