"""``superoptimize``: match → candidates → verify → rank → cache, and the callable result."""

import time
import warnings

import numpy as np

from .._arrays import describe, from_dlpack
from .._cuda import SIMULATOR, simulate
from .._version import __version__
from ..configs.attention import split_options, tile_candidates
from ..kernels.launch import device_limits
from ..ops.attention import validate
from ..tuning import cache
from .match import find_attention
from .plans import Plan, Runner, _as_bhsd, _swap_last, torch_signature
from .tune import SearchLog, model_seconds, search, time_seconds
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


def input_layouts(graph, device):
    """Uninitialised arrays like ``random_inputs``'s (library, dtype, device, contiguous): what
    ``candidates`` reads of the caller's arrays, at no cost of drawing values."""
    dtype = graph.inputs[0].dtype.name
    if device is not None or dtype == "bfloat16":
        import torch

        where = f"cuda:{device}" if device is not None else "cpu"
        return [torch.empty(t.dims, dtype=getattr(torch, dtype), device=where) for t in graph.inputs]
    return [np.empty(t.dims, np.float16 if dtype == "float16" else np.float32) for t in graph.inputs]


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
    sample_inputs = {t.node.index: x for t, x in zip(graph.inputs, sample, strict=True)}
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
        problem = validate(views[0], k, views[2], None, False, m.scale, "bhsd", False)
        misfits = []
        for config in tile_candidates(problem, misfits):  # key splits: runs of keys in parallel, for short grids
            plans += [Plan("fused", matches, config, layout, n) for n in split_options(problem, config)]
        pruned += [(Plan("fused", matches, config, layout), reason) for config, reason in misfits]
    return plans, pruned


class OptimizedGraph:
    """The result of ``superoptimize``: call it with the graph's inputs — positionally, as one list or
    tuple, or as ``inputs=[...]`` — to get a list with one array per output."""

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
        if inputs is None and len(args) == 1 and isinstance(args[0], (list, tuple)):
            inputs = args[0]  # optimized_graph([q, k, v]), as Mirage's tutorials call it
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
        for i, (x, t) in enumerate(zip(arrays, declared, strict=True)):
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
        try:
            graph = self.graph.with_input_dims(dims)
        except ValueError as e:
            declared = ", ".join(str(t.dims) for t in self.graph.inputs)
            raise ValueError(f"input shapes {', '.join(map(str, dims))} are inconsistent with the graph "
                             f"(declared {declared}): {e}") from None
        runner = Runner(graph, _same_plan(self.plan, graph))
        self._runners[tuple(dims)] = runner
        return runner

    def explain(self, file=None):
        """Print the candidates (plan, verified?, time) and the winner, in columns as wide as their content."""
        cells = [("candidate", "verified", "time", "note")] + [
            (row["plan"], "yes" if row["verified"] else "no",
             f"{row['seconds'] * 1e6:.1f} us" if row["seconds"] is not None else "-", row["note"])
            for row in self.table]
        plan_w, verified_w, time_w = (max(len(c[i]) for c in cells) for i in range(3))
        lines = [f"{p:{plan_w}} {v:>{verified_w}} {t:>{time_w}}  {n}".rstrip() for p, v, t, n in cells]
        lines.append(f"winner: {self.plan.describe()}")
        print("\n".join(lines), file=file)


def _same_plan(plan, graph):
    """``plan``'s kind, configuration, key layout and splits for ``graph`` (another shape of its graph)."""
    matches = tuple(find_attention(graph)) if plan.kind == "fused" else ()
    return Plan(plan.kind, matches, plan.config, plan.k_layout, plan.splits) if matches else Plan("unfused")


def _device_id():
    if SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def superoptimize(graph, config="attention", backend=None, warmup_iters=16, profile_iters=1000,
                  previous_checkpoint=None, verbose=True, seed=None):
    """Search the plans of ``graph``, verify each against it, rank the verified ones, cache the winner.

    Stages: candidates enumerated (tile configurations and key splits the kernels offer) and pruned
    (those the device cannot hold); in the cost model's order, up to ``MAX_TRIED`` checked for
    equivalence with the graph (finite-field fingerprints), compiled, run and verified against a
    float64 evaluation, then timed: on a GPU ``warmup_iters`` calls, then ``profile_iters`` calls in
    batches timed with CUDA events; without one the kernels are verified in numba's CUDA simulator
    at small proxy shapes (they are shape-generic) and a cost model ranks them, and the winner runs
    on the CPU path. ``verbose`` (the default) reports each stage on stderr as it ends, with a live
    bar on a terminal. The result is cached on disk (see ``cache.py``) and returned as an
    ``OptimizedGraph``."""
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
    log = SearchLog(verbose)
    started = time.perf_counter()
    device = _device_id()
    limits = device_limits(0 if device is None else device)
    matches = find_attention(graph)
    log.stage(f"{len(graph.nodes) - len(graph.inputs)} operations on inputs "
              f"{', '.join(str(t.dims) for t in graph.inputs)}; {len(matches)} attention subgraph(s) matched; "
              f"device: {limits['name']}")
    plans, pruned = candidates(graph, input_layouts(graph, device))
    key = cache.cache_key(graph, limits, __version__)
    path = cache.cache_path(previous_checkpoint)
    hit = cache.load(path, key)
    if hit is not None:
        plan = Plan(hit["kind"], tuple(matches) if hit["kind"] == "fused" else (), hit["config"], hit["k_layout"],
                    hit["splits"])
        if plan in plans:
            log.stage(f"from the cache ({path}): {plan.describe()}")
            return OptimizedGraph(graph, plan, hit["table"])
        warnings.warn(f"ignoring numattn tuning cache entry in {path}: {plan.describe()} is not a candidate of "
                      "this graph", cache.CacheWarning, stacklevel=2)

    rng = np.random.default_rng(seed)
    modelled = sorted((model_seconds(graph, plan), i, plan) for i, plan in enumerate(plans))
    log.stage(f"{len(plans) + len(pruned)} candidates enumerated ({len(plans) - 1 + len(pruned)} fused, 1 unfused); "
              f"{len(pruned)} pruned before compiling (shared memory or registers)")
    simulated = device is None and SIMULATOR
    table = [{"plan": plan.describe(), "verified": False, "seconds": None, "note": f"pruned: {reason}"}
             for plan, reason in pruned]
    counts = {"tried": 0, "equivalent": 0, "ran": 0, "verified": 0}
    semantics_verdict = {}

    def skip(candidate, best):
        model, _, _ = candidate
        if best is not None and (counts["tried"] >= MAX_TRIED or model > PRUNE_RATIO * modelled[0][0]):
            return f"not tried: modelled {model * 1e6:.1f} us, best modelled {modelled[0][0] * 1e6:.1f} us"
        return None

    def verify(candidate):
        _, _, plan = candidate
        counts["tried"] += 1
        semantics = plan.semantics(graph)
        text = semantics.canonical()
        if text not in semantics_verdict:
            semantics_verdict[text] = fingerprint_check(graph, semantics, rng)
        reason = semantics_verdict[text]
        if reason is not None:
            return False, reason, None
        counts["equivalent"] += 1
        runner = Runner(graph, plan)
        if simulated:  # the kernels' logic at small shapes: full ones would take minutes in the simulator
            proxy_graph, proxy_plan = proxy(graph, plan)
            with simulate():
                reason, error = numeric_check(proxy_graph, Runner(proxy_graph, proxy_plan),
                                              lambda: random_inputs(proxy_graph, rng, None))
            where = f" (simulated at {', '.join(str(t.dims) for t in proxy_graph.inputs)})"
        else:
            reason, error = numeric_check(graph, runner, lambda: random_inputs(graph, rng, device))
            where = ""
        counts["ran"] += not (reason or "").startswith("failed to run")
        if reason is not None:
            return False, reason, None
        counts["verified"] += 1
        return True, f"max rel. error {error:.1e}{where}" + (", modelled time" if device is None else ""), runner

    def measure(candidate, runner):
        model, _, plan = candidate
        if device is None:
            return model
        sets = [random_inputs(graph, rng, device)[0] for _ in range(4)]
        return time_seconds(runner, sets, warmup_iters, profile_iters)

    rows, best, best_seconds = search(modelled, lambda c: c[2].describe(), verify, measure,
                                      log.bar(min(MAX_TRIED, len(modelled)), "verify"), skip)
    table += rows
    best = best[2] if best is not None else None
    tried = counts["tried"]
    where = "in the simulator at proxy shapes" if simulated else "on " + limits["name"]
    log.stage(f"{tried} tried in the cost model's order: {counts['equivalent']} equivalent to the graph, "
              f"{counts['ran']} compiled and ran {where}, {counts['verified']} verified against float64")
    if best is None:
        raise RuntimeError("no candidate passed verification:\n" + "\n".join(f"{r['plan']}: {r['note']}" for r in table))
    timing = "modelled (no GPU)" if device is None else f"timed with CUDA events, {profile_iters} calls each"
    log.stage(f"{counts['verified']} {timing}; {len(modelled) - tried} not tried (modelled slower)")
    cache.store(path, key, best, table)
    log.stage(f"winner: {best.describe()}, {best_seconds * 1e6:.1f} us; searched in "
              f"{time.perf_counter() - started:.1f} s, stored in {path}")
    return OptimizedGraph(graph, best, table)


PROXY_QUERIES = 20  # query rows of a simulated verification: two query tiles of the simulator's kernels
PROXY_BATCH = 2


def proxy(graph, plan):
    """``(graph, plan)`` that verify ``plan``'s kernels at small shapes: for a graph whose inputs are the
    query, key and value of one attention subgraph, every batch extent cut to ``PROXY_BATCH``, the
    queries to ``PROXY_QUERIES`` and the keys to two key tiles per split and a partial tile, their
    count kept modulo 8 (16-byte alignment, which selects how the kernels copy K); head dims (which
    select the kernels) kept. Other graphs: themselves."""
    matches = find_attention(graph)
    if len(matches) != 1 or len(graph.inputs) != 3:
        return graph, plan
    m = matches[0]
    roles = {graph.nodes[i].attrs.get("position"): role for i, role in ((m.q, "q"), (m.k, "k"), (m.v, "v"))}
    if set(roles) != {0, 1, 2}:
        return graph, plan
    block_n = getattr(plan.config, "block_n", 16)
    seqlen_kv = graph.nodes[m.v].output.dims[-2]
    keys = 2 * plan.splits * block_n + 8 + seqlen_kv % 8
    dims = []
    for t in graph.inputs:
        *batch, rows, cols = t.dims
        batch = [min(b, PROXY_BATCH) for b in batch]
        role = roles[t.node.attrs["position"]]
        if role == "q":
            rows = min(rows, PROXY_QUERIES)
        elif role == "k":
            cols = min(cols, keys)
        else:
            rows = min(rows, keys)
        dims.append((*batch, rows, cols))
    small = graph.with_input_dims(dims)
    return small, _same_plan(plan, small)
