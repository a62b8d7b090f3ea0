"""Equivalence checks that every candidate passes before it may win.

(a) Fingerprint: the candidate's semantics (``Plan.semantics``) and the input
graph evaluated in the finite field (``interpret.py``) on fresh random inputs,
several independent trials, on a copy of both graphs with every extent shrunk
(an injective map of the extents, so that the graphs stay well formed and the
check takes milliseconds). (b) Numeric: the candidate's kernels run on fresh
random inputs at the real shapes and are compared with the float64
interpretation of the graph, with a tolerance for the graph's dtype.
"""

import numpy as np

from .._arrays import describe, float32_values, host_storage
from .graph import Graph
from .interpret import (
    DivisionByZero,
    FingerprintUnsupported,
    evaluate,
    fingerprint,
    max_coefficients,
    random_field_inputs,
)

TRIALS = 3
# a candidate's largest error over the largest magnitude of what it is checked against (the float64
# reference of a graph, or the heuristic's output in numattn.tune), per dtype of its inputs
TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-3}


def shrink(graph, extents):
    """A copy of ``graph`` with each extent e > 1 replaced by ``extents[e]``."""
    out = Graph()
    copies = {}
    for node in graph.nodes:
        dims = tuple(extents.get(d, d) for d in node.output.dims)
        if node.op == "input":
            t = out.new_input(dims, node.output.dtype)
        else:
            t = out._add(node.op, [copies[i.node.index] for i in node.inputs], node.attrs, dims, node.output.dtype)
        copies[node.index] = t
    for r in graph.results():
        out.mark_output(copies[r.node.index])
    return out


def small_extents(graph):
    """An injective map of the graph's extents > 1 to small ones (3, 4, 5, …)."""
    distinct = sorted({d for n in graph.nodes for d in n.output.dims if d > 1})
    return {e: 3 + i for i, e in enumerate(distinct)}


def fingerprint_check(graph, candidate_graph, rng, trials=TRIALS):
    """``None`` when the two graphs agree on every trial, else the reason they do not."""
    extents = small_extents(graph)
    a, b = shrink(graph, extents), shrink(candidate_graph, extents)
    done = 0
    for _ in range(4 * trials):
        inputs = random_field_inputs(a, rng)
        coefficients = max_coefficients(a, rng)
        try:
            want, got = fingerprint(a, inputs, coefficients), fingerprint(b, inputs, coefficients)
        except DivisionByZero:
            continue  # a zero divisor drawn by chance: new inputs
        except FingerprintUnsupported as e:
            return f"fingerprint unsupported: {e}"
        if len(want) != len(got):
            return f"fingerprint: {len(got)} outputs instead of {len(want)}"
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if w.p.shape != g.p.shape or not np.array_equal(w.p, g.p) or not np.array_equal(w.q, g.q):
                return f"fingerprint: output {i} differs (trial {done + 1})"
        done += 1
        if done == trials:
            return None
    return "fingerprint: too many zero divisors"


def numeric_check(graph, runner, make_inputs):
    """``(None, error)`` when the candidate's outputs match float64 within tolerance, else
    ``(reason, error)``; ``make_inputs()`` draws fresh inputs as ``(caller arrays, float64 arrays)``."""
    arrays, exact = make_inputs()
    try:
        outputs = runner(arrays)
    except Exception as e:  # a candidate that fails to compile or launch is rejected, not fatal
        return f"failed to run: {type(e).__name__}: {e}", None
    reference = evaluate(graph, exact)
    tolerance = TOLERANCE[graph.inputs[0].dtype.name]
    if len(outputs) != len(reference):
        return f"{len(outputs)} outputs instead of {len(reference)}", None
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        got = to_float64(out)
        if got.shape != ref.shape:
            return f"output {i} has shape {got.shape}, expected {ref.shape}", None
        if not np.all(np.isfinite(got)):
            return f"output {i} is not finite", None
        error = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        worst = max(worst, error)
        if error > tolerance:
            return f"output {i}: relative error {error:.2e} > {tolerance:.0e}", error
    return None, worst


def to_float64(x):
    """Any supported array (host or device) as a float64 numpy array."""
    op = describe(x, "output")
    if op.kind == "torch":
        return x.detach().float().cpu().double().numpy()
    if op.device is not None and op.kind != "numpy":
        x = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
        return np.asarray(x, dtype=np.float64)
    return float32_values(host_storage(x, op), op.dtype).astype(np.float64)
