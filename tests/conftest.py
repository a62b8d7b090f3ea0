import os

import numpy as np
import pytest

# Without a GPU, host arrays run the GPU kernels in numba's CUDA simulator: the tests check the kernels'
# logic; tests of the CPU path select it with ``numattn.simulate(False)``.
os.environ.setdefault("NUMATTN_SIMULATE", "1")

import numattn  # noqa: E402  (first of the package: selects the simulator when there is no GPU)

# Absolute tolerance on outputs of unit-variance attention, per input dtype:
# a few ulps of the output format after fp32 accumulation.
ATOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (running in numba's CUDA simulator)")
    for item in items:
        if "gpu" in item.keywords and numattn.SIMULATOR:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    """A fresh generator per test; its seed is printed so that a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def splits(monkeypatch, fresh_plans):
    """``force(count)``: decode's key splits forced to ``count`` (the heuristic gives 1 in the simulator
    for the tests' sizes)."""
    from numattn.ops import decode as module

    def force(count):
        real = module._splits
        monkeypatch.setattr(module, "_splits", lambda p, rows, *args: (count, real(p, rows, *args)[1]))
        fresh_plans.clear()  # plans made before the count was forced

    return force


@pytest.fixture
def fresh_plans():
    """The ops' plan cache, emptied before and after the test: calls plan again (consulting the tuning
    cache and whatever the test patched), and plans made under a test's patches do not outlive it."""
    from numattn.ops.plans import PLANS

    PLANS.clear()
    yield PLANS
    PLANS.clear()
