"""asv benchmark of numattn.torch.attention forward + backward on the GPU (skipped without one):
median milliseconds of CUDA-event-timed steps (W8's shape family at a size the CUDA-core backward
finishes quickly)."""

import numattn
from numattn.bench import cuda_time_ms


class AttentionForwardBackward:
    params = ([False, True],)
    param_names = ["causal"]
    timeout = 300

    def setup(self, causal):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        import numattn.torch as nt

        self.nt = nt
        self.q, self.k, self.v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
        self.causal = causal
        self.step()  # compile outside the timing

    def step(self):
        o = self.nt.attention(self.q, self.k, self.v, causal=self.causal)
        o.backward(self.do)

    def track_ms(self, causal):
        return cuda_time_ms(self.step)

    track_ms.unit = "ms"
