"""asv benchmarks of numattn.torch.attention forward + backward on the GPU (skipped without one):
median milliseconds of CUDA-event-timed steps, bf16, W8's shape family at a quarter of its size
(B1 H16 L2048; the full W8 table: ``python -m numattn bench --training``), and causal steps with each
score modification (``benchmarks/variants.py --training`` compares them with FlexAttention)."""

import numattn
from numattn.bench import cuda_time_ms

from .attention import VARIANTS, variant_options


class AttentionForwardBackward:
    params = ([64, 128], [False, True])
    param_names = ["head_dim", "causal"]
    timeout = 300

    def setup(self, head_dim, causal):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        import numattn.torch as nt

        self.nt = nt
        shape = (1, 16, 2048, head_dim)
        self.q, self.k, self.v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.causal = causal
        self.step()  # compile outside the timing

    options = {}  # score modifications (the variants below)

    def step(self):
        self.q.grad = self.k.grad = self.v.grad = None
        o = self.nt.attention(self.q, self.k, self.v, causal=self.causal, **self.options)
        o.backward(self.do)

    def track_ms(self, head_dim, causal):
        return cuda_time_ms(self.step)

    track_ms.unit = "ms"


class ForwardBackwardVariants(AttentionForwardBackward):
    """Causal steps of B1 H16 L4096 D128 with each score modification (``VARIANTS``)."""

    params = (VARIANTS,)
    param_names = ["variant"]

    def setup(self, variant):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        import numattn.torch as nt

        self.nt = nt
        shape = (1, 16, 4096, 128)
        self.q, self.k, self.v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.causal, self.options = True, variant_options(variant, torch.rand(16, device="cuda", dtype=torch.float32))
        self.step()  # compile outside the timing

    def track_ms(self, variant):
        return cuda_time_ms(self.step)

    track_ms.unit = "ms"
