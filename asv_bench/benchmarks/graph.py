"""asv benchmarks of the kernel-graph superoptimizer: search time (uncached, a fresh cache directory)
and the optimized Mirage GQA graph's per-call time (1000 back-to-back calls), on the GPU."""

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
        self.cache.cleanup()

    def track_search_s(self, b):
        start = time.perf_counter()
        mirage_gqa_graph(b).superoptimize(config="attention")
        return time.perf_counter() - start

    def track_call_us(self, b):
        optimized = self.graph.superoptimize(config="attention")
        return loop_us(lambda: optimized(*self.inputs))

    track_search_s.unit = "s"
    track_call_us.unit = "us"
