"""Two interpreters of a kernel graph: float64 numpy (the numeric reference) and a finite field
(the fingerprint that proves two graphs compute the same function, in the style of Mirage).

Fingerprints live in Z_P × Z_Q with P = 2Q + 1 (both prime): a value is the pair
``(x mod P, x mod Q)`` of an integer ``x``. Sums, products and quotients act on
each part (quotients by inverses). ``exp(x)`` is ``ω^(x mod Q) mod P`` with ω
of order Q, so that ``exp(a + b) = exp(a) · exp(b)`` holds exactly in the P
part; its Q part is unknown (an exp of an exp is not supported). A row maximum
has no field analogue: it becomes a random symmetric function of the row (fresh
per trial), so that only graphs in which the maximum cancels, as it does in a
max-subtracted softmax, agree with graphs that never compute it. sqrt is the
fixed map ``x^((m+1)/4)`` in each part (P and Q are 3 mod 4: a square root of x
or of -x), the same in every graph.
"""

from fractions import Fraction

import numpy as np

Q = 1048571
P = 2 * Q + 1
OMEGA = 4  # a square, hence of order Q in Z_P*
UNKNOWN = -1  # a Q part that the field cannot follow (after exp)


class FingerprintUnsupported(Exception):
    """The graph uses an operation the finite field cannot represent (an exp of an exp)."""


class DivisionByZero(Exception):
    """A trial divided by a zero field element; the caller draws new inputs."""


# -- float64 ------------------------------------------------------------------------------------
def _silu(x):
    return x / (1.0 + np.exp(-x))


_FLOAT_OPS = {
    "exp": np.exp, "sqrt": np.sqrt, "square": np.square, "silu": _silu,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "matmul": np.matmul,
}


def evaluate(graph, inputs):
    """The graph's results in float64 for ``inputs`` (numpy arrays, one per graph input, in order)."""
    values = {}
    for node in graph.nodes:
        args = [values[i.node.index] for i in node.inputs]
        if node.op == "input":
            out = np.asarray(inputs[node.attrs["position"]], dtype=np.float64)
        elif node.op == "mul_scalar":
            out = args[0] * node.attrs["scalar"]
        elif node.op == "reduction":
            out = args[0].sum(axis=node.attrs["dim"], keepdims=True)
        elif node.op == "reduction_max":
            out = args[0].max(axis=node.attrs["dim"], keepdims=True)
        elif node.op == "rms_norm":
            x = args[0]
            out = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + node.attrs["eps"])
        else:
            out = _FLOAT_OPS[node.op](*args)
        values[node.index] = out
    return [values[t.node.index] for t in graph.results()]


# -- finite field ---------------------------------------------------------------------------------
def _pow(base, exponent, modulus):
    """Elementwise ``base ** exponent % modulus`` for int64 arrays (exponents ≥ 0)."""
    base, exponent = np.asarray(base, dtype=np.int64) % modulus, np.asarray(exponent, dtype=np.int64)
    result = np.ones(np.broadcast(base, exponent).shape, dtype=np.int64)
    while np.any(exponent > 0):
        odd = (exponent & 1) == 1
        result = np.where(odd, result * base % modulus, result)
        base, exponent = base * base % modulus, exponent >> 1
    return result


def _inverse(x, modulus):
    if np.any(x % modulus == 0):
        raise DivisionByZero
    return _pow(x, modulus - 2, modulus)


def _field_scalar(value, modulus):
    """A real constant as a field element: its exact rational value n/d as n · d⁻¹."""
    frac = Fraction(value)
    return frac.numerator % modulus * pow(frac.denominator % modulus, modulus - 2, modulus) % modulus


class Field:
    """A tensor of field elements: its P part and Q part (``UNKNOWN`` entries where undefined)."""

    def __init__(self, p, q):
        self.p, self.q = np.asarray(p, dtype=np.int64), np.asarray(q, dtype=np.int64)

    @property
    def q_known(self):
        return not np.any(self.q == UNKNOWN)

    def _q_or_unknown(self, other, combine):
        if self.q_known and other.q_known:
            return combine(self.q, other.q) % Q
        return np.full(np.broadcast(self.q, other.q).shape, UNKNOWN, dtype=np.int64)

    def add(self, o):
        return Field((self.p + o.p) % P, self._q_or_unknown(o, np.add))

    def sub(self, o):
        return Field((self.p - o.p) % P, self._q_or_unknown(o, np.subtract))

    def mul(self, o):
        return Field(self.p * o.p % P, self._q_or_unknown(o, np.multiply))

    def div(self, o):
        q = self._q_or_unknown(o, lambda a, b: a * _inverse(b, Q)) if o.q_known else None
        if q is None:
            q = np.full(np.broadcast(self.q, o.q).shape, UNKNOWN, dtype=np.int64)
        return Field(self.p * _inverse(o.p, P) % P, q)

    def scale(self, value):
        q = self.q * _field_scalar(value, Q) % Q if self.q_known else self.q
        return Field(self.p * _field_scalar(value, P) % P, q)

    def unknown_q(self, p):
        return Field(p, np.full(p.shape, UNKNOWN, dtype=np.int64))

    def exp(self):
        if not self.q_known:
            raise FingerprintUnsupported("exp of a value that itself went through exp")
        return self.unknown_q(_pow(OMEGA, self.q, P))

    def sqrt(self):  # P ≡ Q ≡ 3 (mod 4): x^((m+1)/4) is a square root of x or of -x in each part
        q = _pow(self.q, (Q + 1) // 4, Q) if self.q_known else self.q
        return Field(_pow(self.p, (P + 1) // 4, P), q)

    def matmul(self, o):
        p = _modmatmul(self.p, o.p, P)
        q = _modmatmul(self.q, o.q, Q) if self.q_known and o.q_known else np.full(p.shape, UNKNOWN, np.int64)
        return Field(p, q)

    def sum(self, dim):
        q = self.q.sum(axis=dim, keepdims=True) % Q if self.q_known else self.q.take([0], axis=dim)
        return Field(self.p.sum(axis=dim, keepdims=True) % P, q)


def _modmatmul(a, b, modulus):
    """``a @ b mod modulus`` without int64 overflow: the inner dim in chunks (products < 2⁴²)."""
    k = a.shape[-1]
    out = None
    for lo in range(0, k, 1 << 20):
        part = np.matmul(a[..., lo:lo + (1 << 20)], b[..., lo:lo + (1 << 20), :]) % modulus
        out = part if out is None else (out + part) % modulus
    return out


def _symmetric_row_function(x, dim, coefficients, modulus):
    """A random function of each row's multiset of values (sorted, then a random linear form)."""
    ordered = np.sort(np.moveaxis(x, dim, -1), axis=-1)
    folded = (ordered * coefficients[: ordered.shape[-1]] % modulus).sum(axis=-1, keepdims=True) % modulus
    return np.moveaxis(folded, -1, dim)


def fingerprint(graph, inputs, max_coefficients):
    """The graph's results in the field for field ``inputs`` (``Field`` per graph input).

    ``max_coefficients`` (int64 pairs, one per position in a row) define this
    trial's stand-in for ``reduction_max``."""
    values = {}
    for node in graph.nodes:
        args = [values[i.node.index] for i in node.inputs]
        op = node.op
        if op == "input":
            out = inputs[node.attrs["position"]]
        elif op in ("add", "sub", "mul", "div", "matmul"):
            out = getattr(args[0], op)(args[1])
        elif op == "mul_scalar":
            out = args[0].scale(node.attrs["scalar"])
        elif op == "exp":
            out = args[0].exp()
        elif op == "sqrt":
            out = args[0].sqrt()
        elif op == "square":
            out = args[0].mul(args[0])
        elif op == "silu":  # x / (1 + exp(-x))
            x = args[0]
            one = Field(np.ones_like(x.p), np.ones_like(x.q))
            out = x.div(one.add(x.scale(-1.0).exp()))
        elif op == "reduction":
            out = args[0].sum(node.attrs["dim"])
        elif op == "reduction_max":
            x, dim = args[0], node.attrs["dim"]
            p = _symmetric_row_function(x.p, dim, max_coefficients[0], P)
            q = (_symmetric_row_function(x.q, dim, max_coefficients[1], Q) if x.q_known
                 else np.full(p.shape, UNKNOWN, dtype=np.int64))
            out = Field(p, q)
        elif op == "rms_norm":
            x = args[0]
            mean = x.mul(x).sum(-1).scale(Fraction(1, x.p.shape[-1]))
            eps = Field(np.full((1,), _field_scalar(node.attrs["eps"], P)), np.full((1,), _field_scalar(node.attrs["eps"], Q)))
            out = x.div(mean.add(eps).sqrt())
        else:
            raise FingerprintUnsupported(f"no field semantics for {op}")
        values[node.index] = out
    return [values[t.node.index] for t in graph.results()]


def random_field_inputs(graph, rng):
    """Fresh uniform field elements for each input of ``graph``."""
    return [Field(rng.integers(0, P, t.dims), rng.integers(0, Q, t.dims)) for t in graph.inputs]


def max_coefficients(graph, rng):
    """A trial's random coefficients for ``reduction_max`` rows (long enough for any row of the graph)."""
    longest = max(max(n.output.dims) for n in graph.nodes)
    return rng.integers(1, P, longest), rng.integers(1, Q, longest)
