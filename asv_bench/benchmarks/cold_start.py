"""asv benchmarks of a process's first calls. ``track_first_call_s``: the first ``numattn.attention``
in a fresh process with the kernel cache filled and with it off (GPU only; skipped without one).
``track_first_training_step_s``: the first forward + backward into an empty cache, with the
backward's kernels compiled ahead in a worker process and without (GPU only).
``time_cache_hit``: the host's share of loading one kernel from the cache (its key over the kernel's
closures and one entry read back and checked), on any machine. ``track_precompile_s``: filling an
empty cache ahead of time; ``track_precompile_for_a_gpu_model_s``: the same for an H100 without one (any
machine: the kernels are planned and compiled for the model, nothing runs)."""

import os
import shutil
import tempfile

import numattn
from numattn.configs.attention import MmaConfig
from numattn.kernels import kernel_cache
from numattn.kernels.attention_mma import mma_attention_kernel


class KernelCacheHit:
    def setup(self):
        self.directory = tempfile.mkdtemp()
        os.environ["NUMATTN_KERNEL_CACHE"] = self.directory
        self.kernel = mma_attention_kernel(MmaConfig(64, 4, 1, True), "float16", 128, 128, True, True)
        self.argtypes = ("array(uint16, 4d, A)",) * 4 + ("array(float32, 3d, A)", "float32")
        key = kernel_cache.kernel_key(self.kernel, self.argtypes, (9, 0))
        kernel_cache.cached_kernel(key, lambda: kernel_cache.Entry("label", "_Z6kernel", os.urandom(100_000)))

    def teardown(self):
        os.environ.pop("NUMATTN_KERNEL_CACHE", None)
        shutil.rmtree(self.directory, ignore_errors=True)

    def time_cache_hit(self):
        key = kernel_cache.kernel_key(self.kernel, self.argtypes, (9, 0))
        kernel_cache.cached_kernel(key, lambda: None)


class _FreshCacheDirectory:
    """A GPU benchmark of first calls in fresh processes, with a kernel cache directory of its own."""

    timeout = 600
    number, repeat = 1, 1

    def setup(self, *params):
        if numattn.SIMULATOR:
            raise NotImplementedError("needs a GPU")
        self.directory = tempfile.mkdtemp()

    def teardown(self, *params):
        if hasattr(self, "directory"):  # (setup may have raised)
            shutil.rmtree(self.directory, ignore_errors=True)


class FirstCall(_FreshCacheDirectory):
    params = ["filled", "off"]
    param_names = ["cache"]

    def setup(self, cache):
        super().setup(cache)
        if cache == "filled":
            from numattn.bench import cold_start_run

            cold_start_run("attention bf16 D128 causal", self.directory)  # compiles and stores

    def track_first_call_s(self, cache):
        from numattn.bench import cold_start_run

        return cold_start_run("attention bf16 D128 causal", self.directory if cache == "filled" else "off")[
            "first_call_s"]

    track_first_call_s.unit = "s"


class FirstTrainingStep(_FreshCacheDirectory):
    params = ["ahead", "in turn"]
    param_names = ["backward compiled"]

    def teardown(self, compiled):
        os.environ.pop("NUMATTN_COMPILE_AHEAD", None)
        super().teardown(compiled)

    def track_first_training_step_s(self, compiled):
        from numattn.bench import cold_start_run

        os.environ["NUMATTN_COMPILE_AHEAD"] = "1" if compiled == "ahead" else "0"
        return cold_start_run("numattn.torch.attention fwd + bwd bf16 D128 GQA", self.directory)["first_call_s"]

    track_first_training_step_s.unit = "s"


class Precompile:
    """``numattn.precompile`` into an empty kernel cache: Llama-3 8B's calls on a GPU, a small attention
    and decode on the CPU path without one."""

    timeout = 900
    number, repeat = 1, 1

    def setup(self):
        self.directory = tempfile.mkdtemp()
        os.environ["NUMATTN_KERNEL_CACHE"] = self.directory

    def teardown(self):
        os.environ.pop("NUMATTN_KERNEL_CACHE", None)
        shutil.rmtree(self.directory, ignore_errors=True)

    def track_precompile_s(self):
        import time

        if numattn.SIMULATOR:
            workloads = [numattn.Workload(op, 4, 2, 64, dtype="float16", seqlen=256) for op in ("attention", "decode")]
        else:
            workloads = ["llama3-8b"]
        start = time.perf_counter()
        report = numattn.precompile(*workloads)
        if any(row["error"] for row in report):
            raise RuntimeError(report)
        return time.perf_counter() - start

    track_precompile_s.unit = "s"

    def track_precompile_for_a_gpu_model_s(self):
        import time

        start = time.perf_counter()
        report = numattn.precompile(*(numattn.Workload(op, 32, 8, 128, seqlen=1024) for op in ("attention", "decode")),
                                    gpu="h100")
        if any(row["error"] for row in report):
            raise RuntimeError(report)
        return time.perf_counter() - start

    track_precompile_for_a_gpu_model_s.unit = "s"
