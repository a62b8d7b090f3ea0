"""asv benchmarks of the CPU path, on machines without a GPU (skipped with one): ``time_*`` the wall
time of one warm call, ``track_tutorial_s`` Mirage's GQA tutorial end to end (search in a fresh
cache, then the call on its second snippet's inputs)."""

import os
import tempfile
import time

import numpy as np

import numattn


def _cpu_path():
    if not numattn.SIMULATOR:
        raise NotImplementedError("the CPU path serves machines without a GPU")


class CpuAttention:
    params = (["float32", "float16"], [False, True])
    param_names = ["dtype", "causal"]

    def setup(self, dtype, causal):
        _cpu_path()
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((2, 16, 1024, 64)).astype(dtype)
        self.k, self.v = (rng.standard_normal((2, 4, 1024, 64)).astype(dtype) for _ in range(2))
        self.time_attention(dtype, causal)  # compile outside the timing

    def time_attention(self, dtype, causal):
        numattn.attention(self.q, self.k, self.v, causal=causal)


class CpuDecode:
    def setup(self):
        _cpu_path()
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((8, 32, 128)).astype(np.float16)
        self.k, self.v = (rng.standard_normal((8, 8, 4096, 128)).astype(np.float16) for _ in range(2))
        self.lengths = np.full(8, 4096, np.int32)
        self.time_decode()

    def time_decode(self):
        numattn.decode(self.q, self.k, self.v, seqlens=self.lengths)


class MirageTutorial:
    timeout = 300

    def setup(self):
        _cpu_path()
        self.cache = tempfile.TemporaryDirectory()
        os.environ["NUMATTN_CACHE_DIR"] = self.cache.name

    def teardown(self):
        if hasattr(self, "cache"):  # not when setup skipped the benchmark
            self.cache.cleanup()

    def track_tutorial_s(self):
        import torch

        start = time.perf_counter()
        graph = numattn.new_kernel_graph()
        q = graph.new_input(dims=(2, 256, 64), dtype=numattn.float16)
        k = graph.new_input(dims=(2, 64, 4096), dtype=numattn.float16)
        v = graph.new_input(dims=(2, 4096, 64), dtype=numattn.float16)
        e = graph.exp(graph.matmul(q, k))
        graph.matmul(graph.div(e, graph.reduction(e, 2)), v)
        optimized = graph.superoptimize(config="attention", verbose=False)
        optimized([torch.randn(64, 1, 128, dtype=torch.float16), torch.randn(64, 128, 4096, dtype=torch.float16),
                   torch.randn(64, 4096, 128, dtype=torch.float16)])
        return time.perf_counter() - start

    track_tutorial_s.unit = "s"
