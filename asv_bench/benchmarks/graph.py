"""asv benchmarks of the kernel-graph superoptimizer: search time (uncached, a fresh cache directory)
and the optimized Mirage GQA graph's per-call time (1000 back-to-back calls) next to the fastest SDPA
backend's on the same values, on the GPU."""

import os
import tempfile
import time

import numattn
from numattn.bench import loop_us, mirage_gqa_graph


class MirageGqa:
    params = ([1, 8],)
    param_names = ["b"]
    timeout = 600

    def setup(self, b):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs an NVIDIA GPU")
        import torch

        self.cache = tempfile.TemporaryDirectory()
        os.environ["NUMATTN_CACHE_DIR"] = self.cache.name
        self.graph = mirage_gqa_graph(b)
        self.inputs = [torch.rand(t.dims, device="cuda", dtype=torch.float16) for t in self.graph.inputs]

    def teardown(self, b):
        if hasattr(self, "cache"):  # not when setup skipped the benchmark
            self.cache.cleanup()

    def track_search_s(self, b):
        start = time.perf_counter()
        mirage_gqa_graph(b).superoptimize(config="attention", verbose=False)
        return time.perf_counter() - start

    def track_call_us(self, b):
        optimized = self.graph.superoptimize(config="attention", verbose=False)
        return loop_us(lambda: optimized(*self.inputs))

    def track_best_sdpa_us(self, b):
        """The fastest SDPA backend on the inputs it is fastest with: contiguous 4-D, K transposed before."""
        import torch

        from numattn.bench import backend_context, sdpa_backends_taking

        q, k, v = (x.unsqueeze(0).contiguous() for x in (self.inputs[0], self.inputs[1].transpose(1, 2), self.inputs[2]))
        times = []
        for name in sdpa_backends_taking(torch, q, k, v, scale=1.0):
            with backend_context(name):
                times.append(loop_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)))
        return min(times)

    track_search_s.unit = "s"
    track_call_us.unit = track_best_sdpa_us.unit = "us"
