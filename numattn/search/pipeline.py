"""``superoptimize``: match → candidates → verify → rank → cache, and the callable result."""

import sys
import time

import numpy as np

from .. import __version__
from .._arrays import describe, from_dlpack
from .._cuda import SIMULATOR
from ..kernels.launch import device_limits
from ..ops.attention import _validate, split_options, tile_candidates
from . import cache
from .graph import KernelGraph
from .match import find_attention
from .plans import Plan, Runner, _as_bhsd, _swap_last, torch_signature
from .tune import Progress, model_seconds, time_seconds
from .verify import fingerprint_check, numeric_check

CONFIGS = ("attention",)
MAX_TRIED = 4  # candidates verified and timed, in the cost model's order
PRUNE_RATIO = 3.0  # untried: modelled slower than this times the best modelled candidate


def random_inputs(graph, rng, device):
    """``(caller arrays, float64 arrays)``: uniform values in [-1, 1] rounded to the graph's dtype; torch
    tensors on GPU ``device``, numpy arrays (torch CPU tensors for bfloat16) otherwise."""
    dtype = graph.inputs[0].dtype.name
    exact, arrays = [], []
    for t in graph.inputs:
        values = rng.uniform(-1.0, 1.0, t.dims).astype(np.float32)
        if device is not None or dtype == "bfloat16":
            import torch

            x = torch.from_numpy(values).to(getattr(torch, dtype))
            exact.append(x.double().numpy())
            arrays.append(x.to(f"cuda:{device}") if device is not None else x)
        else:
            x = values.astype(np.float16 if dtype == "float16" else np.float32)
            exact.append(x.astype(np.float64))
            arrays.append(x)
    return arrays, exact


def candidates(graph, sample):
    """``(plans, pruned)``: every plan worth trying — the unfused plan, and for the graph's attention
    subgraphs one fused plan per key layout and tile configuration that the kernels offer for
    ``sample`` inputs — and ``(plan, reason)`` for the configurations pruned before compiling (too
    much shared memory or registers for the device)."""
    plans, pruned = [Plan("unfused")], []
    matches = tuple(find_attention(graph))
    if not matches:
        return plans, pruned
    m = matches[0]  # tile configurations offered for the first subgraph (all subgraphs share a plan)
    dims = {i: graph.nodes[i].output.dims for i in (m.q, m.k, m.v)}
    sample_inputs = {t.node.index: x for t, x in zip(graph.inputs, sample)}
    if not all(i in sample_inputs for i in dims):
        views = None  # operands computed inside the graph: the heuristic's configuration only
    else:
        q, k, v = (_as_bhsd(sample_inputs[i], dims[i]) for i in (m.q, m.k, m.v))
        views = q, _swap_last(k), v
    for layout in ("copy", "strided"):
        if views is None:
            plans.append(Plan("fused", matches, None, layout))
            continue
        k = views[1]
        if layout == "copy":
            k = k.contiguous() if hasattr(k, "contiguous") else np.ascontiguousarray(k)
        problem = _validate(views[0], k, views[2], None, False, m.scale, "bhsd", False)
        misfits = []
        for config in tile_candidates(problem, misfits):  # key splits: runs of keys in parallel, for short grids
            plans += [Plan("fused", matches, config, layout, n) for n in split_options(problem, config)]
        pruned += [(Plan("fused", matches, config, layout), reason) for config, reason in misfits]
    return plans, pruned


class OptimizedGraph:
    """The result of ``superoptimize``: call it with the graph's inputs (positionally or as
    ``inputs=[...]``) to get a list with one array per output."""

    def __init__(self, graph, plan, table):
        self.graph, self.plan, self.table = graph, plan, table
        self._runners = {self._dims_key(graph): Runner(graph, plan)}
        self._validated = {}  # torch_signature of validated inputs → the callable that runs them

    @staticmethod
    def _dims_key(graph):
        return tuple(t.dims for t in graph.inputs)

    def __call__(self, *args, inputs=None):
        if inputs is not None and args:
            raise TypeError("pass the inputs positionally or as inputs=[...], not both")
        arrays = args if inputs is None else inputs
        signature, pointers = torch_signature(arrays)
        run = self._validated.get(signature) if signature is not None else None
        if run is not None:
            return run(arrays, pointers)
        arrays = list(arrays)
        declared = self.graph.inputs
        if len(arrays) != len(declared):
            raise ValueError(f"the graph has {len(declared)} inputs, got {len(arrays)}")
        arrays = [from_dlpack(x) for x in arrays]
        dims = []
        for i, (x, t) in enumerate(zip(arrays, declared)):
            op = describe(x, f"input {i}")
            if op.dtype != t.dtype.name:
                raise TypeError(f"input {i} must have dtype {t.dtype.name}, got {op.dtype}")
            if len(op.shape) != t.num_dims:
                raise ValueError(f"input {i} must have {t.num_dims} dims like {t.dims}, got shape {op.shape}")
            dims.append(tuple(op.shape))
        runner = self._runners.get(tuple(dims))
        if runner is None:
            runner = self._respecialize(dims)
        if signature is not None:
            self._validated[signature] = runner.entry(arrays, signature)
        return runner(arrays)

    def _respecialize(self, dims):
        """The plan for new input shapes: the graph rebuilt for them (shape checks included), same plan kind."""
        graph = KernelGraph()
        copies = {}
        for node in self.graph.nodes:
            if node.op == "input":
                t = graph.new_input(dims[node.attrs["position"]], node.output.dtype)
            else:
                args = [copies[i.node.index] for i in node.inputs]
                try:
                    t = getattr(graph, node.op)(*args, *_positional(node))
                except ValueError as e:
                    declared = ", ".join(str(t.dims) for t in self.graph.inputs)
                    raise ValueError(
                        f"input shapes {', '.join(map(str, dims))} are inconsistent with the graph "
                        f"(declared {declared}): {e}") from None
            copies[node.index] = t
        for r in self.graph.results():
            graph.mark_output(copies[r.node.index])
        matches = tuple(find_attention(graph)) if self.plan.kind == "fused" else ()
        plan = (Plan(self.plan.kind, matches, self.plan.config, self.plan.k_layout, self.plan.splits) if matches
                else Plan("unfused"))
        runner = Runner(graph, plan)
        self._runners[tuple(dims)] = runner
        return runner

    def explain(self, file=None):
        """Print the candidates (plan, verified?, time) and the winner."""
        lines = [f"{'candidate':72} {'verified':>9} {'time':>12}  note"]
        for row in self.table:
            t = f"{row['seconds'] * 1e6:9.1f} us" if row["seconds"] is not None else "-"
            lines.append(f"{row['plan']:72} {'yes' if row['verified'] else 'no':>9} {t:>12}  {row['note']}")
        lines.append(f"winner: {self.plan.describe()}")
        print("\n".join(lines), file=file)


def _positional(node):
    if node.op in ("reduction", "reduction_max"):
        return (node.attrs["dim"],)
    if node.op == "mul_scalar":
        return (node.attrs["scalar"],)
    if node.op == "rms_norm":
        return (node.attrs["eps"],)
    return ()


def _device_id():
    if SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def superoptimize(graph, config="attention", backend=None, warmup_iters=16, profile_iters=1000,
                  previous_checkpoint=None, verbose=False, seed=None):
    """Search the plans of ``graph``, verify each against it, rank the verified ones, cache the winner.

    On a GPU each verified candidate is timed (``warmup_iters`` calls, then
    ``profile_iters`` calls in batches timed with CUDA events); in the simulator
    a cost model ranks them. The result is cached on disk (see ``cache.py``)
    and returned as an ``OptimizedGraph``."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")
    if backend not in (None, "cuda"):
        raise ValueError(f"backend must be None or 'cuda', got {backend!r}")
    if not graph.inputs:
        raise ValueError("the graph has no inputs")
    if len({t.dtype for t in graph.inputs}) > 1:
        raise TypeError("every input of the graph must have the same dtype")
    if not graph.results():
        raise ValueError("the graph computes nothing: add operations or mark an output")
    device = _device_id()
    limits = device_limits(0 if device is None else device)
    key = cache.cache_key(graph, limits, __version__)
    path = cache.cache_path(previous_checkpoint)
    hit = cache.load(path, key)
    if hit is not None:
        matches = tuple(find_attention(graph)) if hit["kind"] == "fused" else ()
        plan = Plan(hit["kind"], matches, hit["config"], hit["k_layout"], hit["splits"])
        return OptimizedGraph(graph, plan, hit["table"])

    rng = np.random.default_rng(seed)
    sample, _ = random_inputs(graph, rng, device)
    plans, pruned = candidates(graph, sample)
    modelled = sorted((model_seconds(graph, plan), i, plan) for i, plan in enumerate(plans))
    progress = Progress(len(modelled), verbose or sys.stderr.isatty())
    table = [{"plan": plan.describe(), "verified": False, "seconds": None, "note": f"pruned: {reason}"}
             for plan, reason in pruned]
    best, best_seconds, tried = None, None, 0
    semantics_verdict = {}
    started = time.perf_counter()
    for model, _, plan in modelled:
        row = {"plan": plan.describe(), "verified": False, "seconds": None, "note": ""}
        if best is not None and (tried >= MAX_TRIED or model > PRUNE_RATIO * modelled[0][0]):
            row["note"] = f"not tried: modelled {model * 1e6:.1f} us, best modelled {modelled[0][0] * 1e6:.1f} us"
            table.append(row)
            progress.step(row["plan"])
            continue
        tried += 1
        semantics = plan.semantics(graph)
        text = semantics.canonical()
        if text not in semantics_verdict:
            semantics_verdict[text] = fingerprint_check(graph, semantics, rng)
        reason = semantics_verdict[text]
        runner = Runner(graph, plan)
        if reason is None:
            reason, error = numeric_check(graph, runner, lambda: random_inputs(graph, rng, device))
            if reason is None:
                row["note"] = f"max rel. error {error:.1e}"
        if reason is not None:
            row["note"] = reason
        else:
            row["verified"] = True
            if device is None:
                row["seconds"] = model_seconds(graph, plan)
                row["note"] += ", modelled time"
            else:
                sets = [random_inputs(graph, rng, device)[0] for _ in range(4)]
                row["seconds"] = time_seconds(runner, sets, warmup_iters, profile_iters)
            if best is None or row["seconds"] < best_seconds:
                best, best_seconds = plan, row["seconds"]
        table.append(row)
        progress.step(row["plan"])
    if best is None:
        raise RuntimeError("no candidate passed verification:\n" + "\n".join(f"{r['plan']}: {r['note']}" for r in table))
    if verbose:
        print(f"searched {len(modelled)} candidates ({tried} tried) in {time.perf_counter() - started:.1f} s")
    cache.store(path, key, best, table)
    return OptimizedGraph(graph, best, table)
