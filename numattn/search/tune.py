"""Ranking verified candidates: CUDA-event timing on a GPU, a cost model in the simulator."""

import sys

import numpy as np

# the cost model's device: an H100's copy bandwidth, tensor/CUDA-core rates and SMs, per-launch cost
_BANDWIDTH = 3.0e12
_FLOPS = {"WgmmaConfig": 600e12, "MmaConfig": 300e12, "SimtConfig": 15e12, "unfused": 5e12}
_SMS = 132
_LAUNCH_SECONDS = 5e-6


def model_seconds(graph, plan):
    """Estimated seconds of ``plan``: per kernel, bytes over bandwidth or FLOPs over the kernel's
    rate, whichever is larger, plus a launch cost. A fused kernel's rate counts whole waves of its
    query blocks over the SMs (a grid of 8 blocks uses 8 of 132 SMs)."""
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[graph.inputs[0].dtype.name]
    fused = {m.out: m for m in plan.matches}
    skipped = set().union(*(m.covered for m in plan.matches)) - set(fused)
    total = 0.0
    for node in graph.nodes:
        if node.op == "input" or node.index in skipped:
            continue
        if node.index in fused:
            m = fused[node.index]
            q, k, v = (graph.nodes[i].output.dims for i in (m.q, m.k, m.v))
            out = node.output.dims
            batch = int(np.prod(out[:-2]))
            flops = 2.0 * batch * out[-2] * k[-1] * (q[-1] + v[-1])
            nbytes = itemsize * sum(int(np.prod(d)) for d in (q, k, v, out))
            if plan.k_layout == "copy":
                total += 2 * itemsize * int(np.prod(k)) / _BANDWIDTH + _LAUNCH_SECONDS
            rate = _FLOPS.get(type(plan.config).__name__, _FLOPS["MmaConfig"])  # None: the heuristic's
            if plan.config is not None:  # whole waves of blocks; under four warps a block leaves
                blocks = batch * -(-out[-2] // plan.config.block_m) * plan.splits  # sub-partitions idle
                rate *= blocks / (_SMS * -(-blocks // _SMS)) * min(1.0, plan.config.num_threads / 128)
            if plan.splits > 1:  # the combine: float32 partials written and read back
                total += 2 * 4 * batch * out[-2] * plan.splits * (out[-1] + 1) / _BANDWIDTH + _LAUNCH_SECONDS
        else:
            dims = node.output.dims
            nbytes = 4 * (int(np.prod(dims)) + sum(int(np.prod(i.dims)) for i in node.inputs))
            flops = 2.0 * int(np.prod(dims)) * (node.inputs[0].dims[-1] if node.op == "matmul" else 1)
            rate = _FLOPS["unfused"]
        total += max(nbytes / _BANDWIDTH, flops / rate) + _LAUNCH_SECONDS
    return total


def time_seconds(run, input_sets, warmup_iters, profile_iters):
    """Median seconds per call of ``run(inputs)``: calls back to back, rotating ``input_sets``, in
    batches timed with CUDA events on torch's current stream (host cost included, as in a loop)."""
    import torch

    for i in range(warmup_iters):
        run(input_sets[i % len(input_sets)])
    batches = max(1, min(10, profile_iters // 10))
    per_batch = max(1, profile_iters // batches)
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(per_batch):
            run(input_sets[i % len(input_sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_batch)
    return float(np.median(times))


class Progress:
    """A one-line progress bar on stderr (shown when ``enabled``)."""

    def __init__(self, total, enabled):
        self.total, self.enabled, self.done = total, enabled, 0

    def step(self, label):
        self.done += 1
        if self.enabled:
            filled = 30 * self.done // max(self.total, 1)
            sys.stderr.write(f"\rsearch [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label[:50]:50}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
