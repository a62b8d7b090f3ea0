"""The kernel graph: a small tensor program in the style of Mirage's kernel graphs.

A ``KernelGraph`` holds inputs (``new_input``) and operations, each producing a
``Tensor``. Shapes broadcast as in numpy and are checked when an operation is
added. The graph is plain data: ``nodes`` in creation order, each a ``Node``
with an operator name, input tensors and constant attributes, so that the
interpreter, the matcher and the cache key all walk the same structure.
"""

import hashlib
import operator
from dataclasses import dataclass, field

MAX_RANK = 4


@dataclass(frozen=True)
class DType:
    """An element type of the graph (``numattn.float16``, ``bfloat16``, ``float32``)."""

    name: str

    def __repr__(self):
        return f"numattn.{self.name}"


float16, bfloat16, float32 = DType("float16"), DType("bfloat16"), DType("float32")
DTYPES = {d.name: d for d in (float16, bfloat16, float32)}

UNARY = ("exp", "sqrt", "square", "silu")
_CONSTANTS = {"reduction": ("dim",), "reduction_max": ("dim",), "mul_scalar": ("scalar",), "rms_norm": ("eps",)}
BINARY = ("add", "sub", "mul", "div")


@dataclass(eq=False)
class Tensor:
    """A value of the graph: its shape, element type and the node that computes it."""

    dims: tuple
    dtype: DType
    node: "Node" = field(repr=False)
    graph: "Graph" = field(repr=False)

    @property
    def num_dims(self):
        return len(self.dims)

    def __repr__(self):
        return f"Tensor(dims={self.dims}, dtype={self.dtype!r}, op={self.node.op})"


@dataclass(eq=False)
class Node:
    """One operation: ``op`` applied to ``inputs`` with constant ``attrs``; ``index`` is its position in the graph."""

    op: str
    inputs: tuple
    attrs: dict
    index: int
    output: Tensor = None


def broadcast_dims(a, b, what):
    """numpy broadcasting of two shapes; ValueError naming ``what`` when they do not broadcast."""
    rank = max(len(a), len(b))
    a1, b1 = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    dims = []
    for x, y in zip(a1, b1, strict=True):
        if x != y and 1 not in (x, y):
            raise ValueError(f"{what}: shapes {tuple(a)} and {tuple(b)} do not broadcast")
        dims.append(max(x, y) if 1 not in (x, y) else x * y)
    return tuple(dims)


class Graph:
    """A kernel graph: its nodes, inputs and outputs, built operation by operation. Users build the
    ``KernelGraph`` subclass (``numattn.new_kernel_graph()``), which adds ``superoptimize``."""

    def __init__(self):
        self.nodes = []
        self.inputs = []
        self.outputs = []

    # -- construction --------------------------------------------------------------------------
    def _add(self, op, inputs, attrs, dims, dtype):
        node = Node(op, tuple(inputs), dict(attrs), len(self.nodes))
        node.output = Tensor(tuple(int(d) for d in dims), dtype, node, self)
        self.nodes.append(node)
        return node.output

    def _check(self, op, *tensors):
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"{op}: argument {i} must be a Tensor of this graph, got {type(t).__name__}")
            if t.graph is not self:
                raise ValueError(f"{op}: argument {i} belongs to another graph")
        if len({t.dtype for t in tensors}) > 1:
            raise TypeError(f"{op}: operands must share one dtype, got {', '.join(t.dtype.name for t in tensors)}")

    def new_input(self, dims, dtype=float16, strides=None):
        """A graph input of shape ``dims`` (1 to 4 positive extents) and element type ``dtype``.

        ``strides`` (elements, optional) records the layout the caller will pass;
        any layout is accepted at call time, so it only documents intent."""
        try:
            dims = tuple(operator.index(d) for d in dims)
        except TypeError:
            raise TypeError(f"new_input: dims must be a sequence of ints, got {dims!r}") from None
        if not 1 <= len(dims) <= MAX_RANK or min(dims) < 1:
            raise ValueError(f"new_input: dims must have 1 to {MAX_RANK} positive extents, got {dims}")
        if not isinstance(dtype, DType):
            raise TypeError(f"new_input: dtype must be numattn.float16, bfloat16 or float32, got {dtype!r}")
        if strides is not None and len(tuple(strides)) != len(dims):
            raise ValueError(f"new_input: strides {tuple(strides)} must have one entry per dim of {dims}")
        t = self._add("input", (), {"position": len(self.inputs)}, dims, dtype)
        self.inputs.append(t)
        return t

    def matmul(self, a, b):
        """``a @ b`` over the last two dims; leading (batch) dims broadcast."""
        self._check("matmul", a, b)
        if a.num_dims < 2 or b.num_dims < 2:
            raise ValueError(f"matmul: operands need at least 2 dims, got {a.dims} and {b.dims}")
        if a.dims[-1] != b.dims[-2]:
            raise ValueError(f"matmul: inner dims differ: {a.dims} @ {b.dims} ({a.dims[-1]} vs {b.dims[-2]})")
        batch = broadcast_dims(a.dims[:-2], b.dims[:-2], "matmul batch dims")
        return self._add("matmul", (a, b), {}, batch + (a.dims[-2], b.dims[-1]), a.dtype)

    def _unary(self, op, x):
        self._check(op, x)
        return self._add(op, (x,), {}, x.dims, x.dtype)

    def exp(self, x):
        return self._unary("exp", x)

    def sqrt(self, x):
        return self._unary("sqrt", x)

    def square(self, x):
        return self._unary("square", x)

    def silu(self, x):
        return self._unary("silu", x)

    def _binary(self, op, a, b):
        self._check(op, a, b)
        return self._add(op, (a, b), {}, broadcast_dims(a.dims, b.dims, op), a.dtype)

    def add(self, a, b):
        return self._binary("add", a, b)

    def sub(self, a, b):
        return self._binary("sub", a, b)

    def mul(self, a, b):
        return self._binary("mul", a, b)

    def div(self, a, b):
        return self._binary("div", a, b)

    def mul_scalar(self, x, scalar):
        """``x · scalar`` for a finite real ``scalar``."""
        self._check("mul_scalar", x)
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar != scalar or abs(scalar) == float("inf"):
            raise TypeError(f"mul_scalar: scalar must be a finite real number, got {scalar!r}")
        return self._add("mul_scalar", (x,), {"scalar": float(scalar)}, x.dims, x.dtype)

    def _reduce(self, op, x, dim):
        self._check(op, x)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -x.num_dims <= dim < x.num_dims:
            raise ValueError(f"{op}: dim must be an int in [{-x.num_dims}, {x.num_dims}) for dims {x.dims}, got {dim!r}")
        dim %= x.num_dims
        dims = x.dims[:dim] + (1,) + x.dims[dim + 1:]
        return self._add(op, (x,), {"dim": dim}, dims, x.dtype)

    def reduction(self, x, dim):
        """Sum over ``dim``, keeping it with extent 1 (as Mirage does)."""
        return self._reduce("reduction", x, dim)

    def reduction_max(self, x, dim):
        """Maximum over ``dim``, keeping it with extent 1."""
        return self._reduce("reduction_max", x, dim)

    def rms_norm(self, x, eps=1e-6):
        """``x / sqrt(mean(x², last dim) + eps)``."""
        self._check("rms_norm", x)
        return self._add("rms_norm", (x,), {"eps": float(eps)}, x.dims, x.dtype)

    def mark_output(self, t):
        """Declare ``t`` an output; outputs are returned in the order marked."""
        self._check("mark_output", t)
        if t not in self.outputs:
            self.outputs.append(t)

    def with_input_dims(self, dims):
        """A copy of this graph whose inputs have shapes ``dims`` (one per input, in order), every
        operation added again, so shape checks apply: ValueError where ``dims`` are inconsistent."""
        graph = type(self)()
        copies = {}
        for node in self.nodes:
            if node.op == "input":
                t = graph.new_input(dims[node.attrs["position"]], node.output.dtype)
            else:
                args = [copies[i.node.index] for i in node.inputs]
                constants = [node.attrs[name] for name in _CONSTANTS.get(node.op, ())]
                t = getattr(graph, node.op)(*args, *constants)
            copies[node.index] = t
        for r in self.results():
            graph.mark_output(copies[r.node.index])
        return graph

    # -- inspection ----------------------------------------------------------------------------
    def results(self):
        """The marked outputs, or when none were marked the sinks (tensors no operation reads)."""
        if self.outputs:
            return list(self.outputs)
        read = {id(i) for n in self.nodes for i in n.inputs}
        return [n.output for n in self.nodes if n.op != "input" and id(n.output) not in read]

    def canonical(self):
        """A text form independent of object identity: one line per node reachable from the results."""
        needed, stack = set(), [t.node for t in self.results()]
        while stack:
            node = stack.pop()
            if node.index not in needed:
                needed.add(node.index)
                stack.extend(i.node for i in node.inputs)
        lines = []
        for node in self.nodes:
            if node.index in needed or node.op == "input":
                args = ",".join(str(i.node.index) for i in node.inputs)
                attrs = ",".join(f"{k}={v!r}" for k, v in sorted(node.attrs.items()))
                lines.append(f"{node.index}={node.op}({args})[{attrs}]{node.output.dims}:{node.output.dtype.name}")
        lines.append("out=" + ",".join(str(t.node.index) for t in self.results()))
        return "\n".join(lines)

    def digest(self):
        """Hash of ``canonical()``: the graph part of the tuning-cache key."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:24]
