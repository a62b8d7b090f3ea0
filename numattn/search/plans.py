"""Executable plans for a kernel graph: the candidates that the search verifies and times.

A plan is plain data (``Plan``: a kind, the fused attention subgraph it covers, a
tile configuration, how it hands the key tensor to the kernel) and ``Runner``
executes it on the caller's arrays:

* ``"unfused"``: every operation by its own kernel (``kernels/graph_ops.py``),
  float32 intermediates;
* ``"fused"``: each matched attention subgraph by one fused attention kernel
  (``numattn.attention`` with the plan's tile configuration), the rest unfused.
  The graph's key operand is ``(…, head_dim, seqlen_kv)``; the kernel reads
  ``kᵀ`` either through strides (``k_layout="strided"``: the CUDA-core kernel) or
  from a contiguous copy made by the caller's library (``"copy"``: the
  tensor-core kernels need contiguous rows).
"""

from dataclasses import dataclass, field

import numpy as np

from .._arrays import (
    describe,
    float32_values,
    from_dlpack,
    host_storage,
    is_torch,
    numba_storage_view,
    rounded_storage,
    storage_dtype,
    wrap_host,
)
from .._cuda import SIMULATOR, cuda, simulating
from ..kernels import graph_ops
from ..kernels.launch import compiled
from ..ops.attention import planned
from .match import attention_graph


@dataclass(frozen=True)
class Plan:
    """A candidate: ``kind`` "fused" or "unfused"; for "fused", the attention subgraphs it fuses, the
    kernel's tile configuration and the key layout; ``overrides`` change the fused kernel's
    parameters (scale, reduce_dim, subtracts_max), which only deliberately wrong candidates do."""

    kind: str
    matches: tuple = ()
    config: object = None
    k_layout: str = "copy"
    splits: int = 1
    overrides: dict = field(default_factory=dict, hash=False, compare=False)

    def describe(self):
        if self.kind == "unfused":
            return "unfused: one kernel per operation"
        fixes = "".join(f" {k}={v}" for k, v in self.overrides.items())
        splits = f" splits={self.splits}" if self.splits > 1 else ""
        return f"fused attention {self.config} k={self.k_layout}{splits}{fixes}"

    def semantics(self, graph):
        """The graph this plan computes (what the finite-field check compares with ``graph``)."""
        for match in self.matches:
            graph = attention_graph(graph, match, **self.overrides)
        return graph


def _pad4(shape):
    return (1,) * (4 - len(shape)) + tuple(shape)


class Runner:
    """Runs a ``Plan`` of ``graph`` on arrays like the caller's (torch, numpy, numba, CAI)."""

    def __init__(self, graph, plan):
        self.graph, self.plan = graph, plan
        self.fused = {m.out: m for m in plan.matches}
        self.skipped = set().union(*(m.covered for m in plan.matches)) - set(self.fused)
        self.dtype = graph.inputs[0].dtype.name
        self._attention = {}
        self._entries = {}  # torch_signature → fast closure (or None: the general path)

    # -- storage ↔ float32 ---------------------------------------------------------------------
    def _storage(self, x):
        """A 4-D view of a caller array's storage that kernels index (numpy in the simulator)."""
        op = describe(x, "input")
        if op.device is None or SIMULATOR:
            storage = host_storage(x, op).reshape(_pad4(op.shape))
            return storage if SIMULATOR else cuda.to_device(np.ascontiguousarray(storage), stream=self.stream)
        strides = (0,) * (4 - len(op.shape)) + tuple(op.strides)
        return numba_storage_view(op.ptr, _pad4(op.shape), strides, op.dtype)

    def _empty(self, shape, dtype):
        shape = _pad4(shape)
        if self.host:
            return np.empty(shape, dtype=dtype)
        return cuda.device_array(shape, dtype=dtype, stream=self.stream)

    def _launch(self, kernel, n, *args):
        if self.host:
            compiled(kernel, None, 0, 0, "graph op").launch_arrays(graph_ops.grid(n), graph_ops.THREADS, *args)
        else:
            kernel[graph_ops.grid(n), graph_ops.THREADS, self.stream](*args)

    def _wide(self, value):
        """A value as a 4-D float32 array."""
        kind, x = value
        if kind == "wide":
            return x
        if self.cpu:
            return float32_values(host_storage(x, describe(x, "input")), self.dtype).reshape(_pad4(x.shape))
        src = self._storage(x)
        out = self._empty(src.shape, np.float32)
        self._launch(graph_ops.widen_kernel(self.dtype), out.size, src, out)
        return out

    def _narrow(self, wide, dims, like):
        """A float32 value as an array of the graph's dtype in the caller's library."""
        if self.cpu:
            return wrap_host(rounded_storage(wide, self.dtype).reshape(dims), like, self.dtype)
        if not self.host and is_torch(like) and like.is_cuda:  # into a torch tensor, seen by numba as storage
            import torch

            result = torch.empty(dims, dtype=getattr(torch, self.dtype), device=like.device)
            strides = (0,) * (4 - len(dims)) + tuple(result.stride())
            out = numba_storage_view(result.data_ptr(), _pad4(dims), strides, self.dtype)
            self._launch(graph_ops.narrow_kernel(self.dtype), out.size, wide, out)
            return result
        out = self._empty(dims, storage_dtype(self.dtype))
        self._launch(graph_ops.narrow_kernel(self.dtype), out.size, wide, out)
        if self.host:
            return wrap_host(out.reshape(dims), like, self.dtype)
        if describe(like, "input").device is None:  # host inputs on a GPU machine: results back on the host
            return wrap_host(out.copy_to_host(stream=self.stream).reshape(dims), like, self.dtype)
        return out.reshape(dims)

    def _caller(self, value, dims, like):
        kind, x = value
        return x if kind == "caller" else self._narrow(x, dims, like)

    # -- execution ----------------------------------------------------------------------------
    def entry(self, arrays, signature):
        """The cheapest callable ``run(arrays, pointers)`` for arrays with this ``torch_signature``: a
        closure that only makes views and launches, when the plan is one fused attention over graph
        inputs; else the general interpreter."""
        if signature not in self._entries:
            self._entries[signature] = self._fast_closure(arrays)
        return self._entries[signature] or self._interpret

    def _fast_closure(self, arrays):
        results, nodes = self.graph.results(), self.graph.nodes
        if self.plan.kind != "fused" or len(self.plan.matches) != 1 or len(results) != 1:
            return None
        m = self.plan.matches[0]
        if results[0].node.index != m.out or any(nodes[i].op != "input" for i in (m.q, m.k, m.v)):
            return None
        if not all(is_torch(x) and x.is_cuda for x in arrays):
            return None
        qp, kp, vp = (nodes[i].attrs["position"] for i in (m.q, m.k, m.v))
        q_dims, k_dims, v_dims = (nodes[i].output.dims for i in (m.q, m.k, m.v))
        out_dims, copy = results[0].dims, self.plan.k_layout == "copy"

        def views(arrays):
            k4 = _swap_last(_as_bhsd(arrays[kp], k_dims))
            return _as_bhsd(arrays[qp], q_dims), k4.contiguous() if copy else k4, _as_bhsd(arrays[vp], v_dims)

        scale = self.plan.overrides.get("scale", m.scale)
        attention, _ = planned(*views(arrays), scale=scale, config=self.plan.config, splits=self.plan.splits)
        if copy:
            def run(arrays, pointers=None):
                q4, k4, v4 = views(arrays)
                return [attention(q4, k4, v4, None).view(out_dims)]

            return run
        # keys read in place: only data pointers change between calls, and the output is allocated in
        # the graph's shape (the attention output's layout, without its head axis)
        import torch

        device = arrays[qp].device
        out_template = torch.empty(1, dtype=arrays[qp].dtype, device=device).expand(out_dims)
        empty_like, run_attention = torch.empty_like, attention.on_pointers

        def run(arrays, pointers):
            return [run_attention(empty_like(out_template), pointers[qp], pointers[kp], pointers[vp])]

        return run

    def __call__(self, inputs):
        signature, pointers = torch_signature(inputs)
        if signature is None:
            return self._interpret(inputs)
        return self.entry(inputs, signature)(inputs, pointers)

    def _interpret(self, inputs, pointers=None):
        """The general path: every node in order (``pointers``, of the fast path's call form, unused)."""
        inputs = [from_dlpack(x) for x in inputs]
        like = inputs[0]
        self.host = SIMULATOR  # numpy arrays throughout; on a GPU, host inputs are copied in and out
        self.cpu = SIMULATOR and not simulating()  # numpy operations rather than simulated kernels
        self.stream = 0
        if not self.host and is_torch(like) and like.is_cuda:
            import torch

            self.stream = cuda.external_stream(torch.cuda.current_stream(like.device).cuda_stream)
        values = {}
        for node in self.graph.nodes:
            if node.index in self.skipped:
                continue
            if node.op == "input":
                values[node.index] = ("caller", inputs[node.attrs["position"]])
            elif node.index in self.fused:
                values[node.index] = ("caller", self._attention_call(self.fused[node.index], values, like))
            else:
                values[node.index] = ("wide", self._op(node, values))
        return [self._caller(values[t.node.index], t.dims, like) for t in self.graph.results()]

    def _op(self, node, values):
        args = [self._wide(values[i.node.index]) for i in node.inputs]
        op = node.op
        dim = 3 if op == "rms_norm" else node.attrs.get("dim", 0) + 4 - node.output.num_dims
        if self.cpu:
            return graph_ops.cpu_op(op, args, node.attrs, dim)
        out = self._empty(node.output.dims, np.float32)
        if op in graph_ops._UNARY:
            self._launch(graph_ops.unary_kernel(op), out.size, args[0], out, np.float32(node.attrs.get("scalar", 0.0)))
        elif op in graph_ops._BINARY:
            self._launch(graph_ops.binary_kernel(op), out.size, args[0], args[1], out)
        elif op == "matmul":
            self._launch(graph_ops.matmul_kernel, out.size, args[0], args[1], out)
        else:
            self._launch(graph_ops.reduce_kernel(op, dim), out.size, args[0], out,
                         np.float32(node.attrs.get("eps", 0.0)))
        return out

    def _attention_call(self, match, values, like):
        graph = self.graph
        dims = {i: graph.nodes[i].output.dims for i in (match.q, match.k, match.v)}
        q, k, v = (self._caller(values[i], dims[i], like) for i in (match.q, match.k, match.v))
        q4, k4, v4 = (_as_bhsd(x, dims[i]) for x, i in ((q, match.q), (k, match.k), (v, match.v)))
        k4 = _swap_last(k4)  # (…, head_dim, seqlen_kv) → (…, seqlen_kv, head_dim)
        if self.plan.k_layout == "copy":
            k4 = k4.contiguous() if is_torch(k4) else np.ascontiguousarray(k4)
        scale = self.plan.overrides.get("scale", match.scale)
        key = (match.out, describe(q4, "q").strides, describe(k4, "k").strides, describe(v4, "v").strides)
        plan = self._attention.get(key)
        if plan is None:
            plan, _ = planned(q4, k4, v4, scale=scale, config=self.plan.config, splits=self.plan.splits)
            self._attention[key] = plan
        o = plan(q4, k4, v4, None)
        return o.reshape(graph.nodes[match.out].output.dims)


def torch_signature(arrays):
    """``(signature, pointers)``: what a prepared launch depends on, for a sequence of torch tensors,
    and their data pointers; ``(None, None)`` for other arrays."""
    try:
        pointers = [x.data_ptr() for x in arrays]
        return tuple((x.__class__, x.dtype, x.shape, x.stride(), x.device, p & 15)
                     for x, p in zip(arrays, pointers, strict=True)), pointers
    except (AttributeError, TypeError):
        return None, None


def _as_bhsd(x, dims):
    """A 4-D (batch, heads, seq, dim) view of a tensor with 0 to 2 batch dims (one head when fewer)."""
    if len(dims) == 2:
        return x[None, None]
    if len(dims) == 3:
        return x.unsqueeze(1) if is_torch(x) else x[:, None]
    return x


def _swap_last(x):
    return x.transpose(-1, -2) if is_torch(x) else np.swapaxes(x, -1, -2)
