"""asv benchmarks of numattn.torch.attention forward + backward on the GPU (skipped without one):
median milliseconds of CUDA-event-timed steps, bf16, W8's shape family at a quarter of its size
(B1 H16 L2048; the full W8 table: ``python -m numattn bench --training``), causal steps with each
score modification (``benchmarks/variants.py --training`` compares them with FlexAttention), and causal
steps on packed sequences of one length against the same rows as a dense batch."""

import numattn
from numattn.bench import cuda_time_ms

from .attention import VARIANTS, variant_options


class AttentionForwardBackward:
    params = ([64, 96, 128], [False, True])  # 96: the mma.sync backward, also on sm_90
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


class PackedForwardBackward(AttentionForwardBackward):
    """Causal steps on four sequences of 2048 (H16 D128 bf16): ``numattn.torch.attention_varlen`` on them
    packed, and ``numattn.torch.attention`` on ``[batch, heads, seqlen, head_dim]`` views of the same rows
    (a dense batch: what packing costs)."""

    params = (["dense batch", "packed"],)
    param_names = ["layout"]

    def setup(self, layout):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        import numattn.torch as nt

        batch, seqlen, heads, head_dim = 4, 2048, 16, 128
        rows = (batch * seqlen, heads, head_dim)
        self.q, self.k, self.v = (torch.randn(rows, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(rows, device="cuda", dtype=torch.bfloat16)
        lengths = torch.arange(0, batch * seqlen + 1, seqlen, device="cuda", dtype=torch.int32)
        if layout == "packed":
            self.attend = lambda q, k, v: nt.attention_varlen(q, k, v, lengths, lengths, seqlen, seqlen, causal=True)
            self.grad_out = self.do
        else:
            def dense(x):
                return x.view(batch, seqlen, heads, head_dim).transpose(1, 2)

            self.attend = lambda q, k, v: nt.attention(dense(q), dense(k), dense(v), causal=True)
            self.grad_out = dense(self.do)
        self.step()  # compile outside the timing

    def step(self):
        self.q.grad = self.k.grad = self.v.grad = None
        self.attend(self.q, self.k, self.v).backward(self.grad_out)

    def track_ms(self, layout):
        return cuda_time_ms(self.step)

    track_ms.unit = "ms"
