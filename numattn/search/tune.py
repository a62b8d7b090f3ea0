"""The search loop behind ``superoptimize`` and ``numattn.tune`` (verify, time, keep the fastest), and its
parts: CUDA-event timing on a GPU, a cost model in the simulator, the report on stderr."""

import sys

import numpy as np

from ..tuning.models import BANDWIDTH, FLOPS, LAUNCH_SECONDS, attention_seconds


def model_seconds(graph, plan):
    """Estimated seconds of ``plan``: per kernel, bytes over bandwidth or FLOPs over the kernel's
    rate, whichever is larger, plus a launch cost (``attention_seconds`` for fused attention)."""
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
            if plan.k_layout == "copy":
                total += 2 * itemsize * int(np.prod(k)) / BANDWIDTH + LAUNCH_SECONDS
            total += attention_seconds(q, k, v, node.output.dims, itemsize, plan.config, plan.splits)
            continue
        dims = node.output.dims
        nbytes = 4 * (int(np.prod(dims)) + sum(int(np.prod(i.dims)) for i in node.inputs))
        flops = 2.0 * int(np.prod(dims)) * (node.inputs[0].dims[-1] if node.op == "matmul" else 1)
        total += max(nbytes / BANDWIDTH, flops / FLOPS["unfused"]) + LAUNCH_SECONDS
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
    """A one-line progress bar on stderr (drawn when ``enabled``): ``step(label)`` after each item, ``close()``
    at the end."""

    def __init__(self, total, enabled, label="search"):
        self.total, self.enabled, self.label, self.done = total, enabled, label, 0

    def step(self, item):
        self.done += 1
        if self.enabled:
            filled = 30 * min(self.done, self.total) // max(self.total, 1)
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"{item[:50]:50}")
            sys.stderr.flush()

    def close(self):
        if self.enabled and self.done:
            sys.stderr.write("\n")
            sys.stderr.flush()


class SearchLog:
    """A search's report on stderr: one line per stage, and on a terminal a live bar; silent unless
    ``enabled``."""

    def __init__(self, enabled):
        self.enabled = bool(enabled)

    def stage(self, text):
        if self.enabled:
            print(f"numattn search: {text}", file=sys.stderr, flush=True)

    def bar(self, total, label):
        return Progress(total, self.enabled and sys.stderr.isatty(), label)


def search(candidates, describe, verify, measure, bar, skip=None):
    """The loop every search runs: for each candidate in order, unless ``skip(candidate, best)`` gives a
    reason not to try it, ``verify(candidate)`` gives ``(verified, note, run)``; a verified candidate is
    timed, ``measure(candidate, run)`` seconds, and the fastest kept. Returns ``(rows, best, seconds)``:
    per candidate its row (``describe(candidate)`` as ``"plan"``, ``verified``, ``seconds``, ``note``),
    the fastest verified candidate (None if none) and its seconds."""
    rows, best, best_seconds = [], None, None
    for candidate in candidates:
        row = {"plan": describe(candidate), "verified": False, "seconds": None, "note": ""}
        why_not = skip(candidate, best) if skip is not None else None
        if why_not is not None:
            row["note"] = why_not
            rows.append(row)
            continue
        row["verified"], row["note"], run = verify(candidate)
        if row["verified"]:
            row["seconds"] = measure(candidate, run)
            if best is None or row["seconds"] < best_seconds:
                best, best_seconds = candidate, row["seconds"]
        rows.append(row)
        bar.step(row["plan"])
    bar.close()
    return rows, best, best_seconds
