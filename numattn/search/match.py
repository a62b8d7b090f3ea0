"""Finding attention-shaped subgraphs: ``matmul → [mul_scalar…] → [sub max] → exp → reduction →
div → matmul``, and writing the canonical graph that a fused attention kernel computes."""

from dataclasses import dataclass

from .graph import Graph


@dataclass(frozen=True)
class AttentionMatch:
    """One attention subgraph: the node indices of its query, key (given as ``(…, head_dim, seqlen_kv)``)
    and value tensors, of its output, every node it covers, and its softmax scale."""

    q: int
    k: int
    v: int
    out: int
    covered: frozenset
    scale: float
    subtracts_max: bool


def _consumers(graph):
    users = {n.index: [] for n in graph.nodes}
    for n in graph.nodes:
        for i in n.inputs:
            users[i.node.index].append(n.index)
    return users


def find_attention(graph):
    """Every attention subgraph of ``graph`` whose intermediate tensors nothing else reads."""
    users = _consumers(graph)
    results = {t.node.index for t in graph.results()}
    found = []
    for o in graph.nodes:
        match = _match_at(graph, o, users, results)
        if match is not None:
            found.append(match)
    return found


def _match_at(graph, o, users, results):
    if o.op != "matmul":
        return None
    d, v = o.inputs
    if d.node.op != "div":
        return None
    e, s = d.node.inputs
    if s.node.op != "reduction" or s.node.inputs[0] is not e or e.node.op != "exp":
        return None
    if s.node.attrs["dim"] != e.num_dims - 1 or d.dims != e.dims:
        return None
    covered = [o.index, d.node.index, s.node.index, e.node.index]
    x = e.node.inputs[0]
    subtracts_max = False
    if x.node.op == "sub":
        scores, m = x.node.inputs
        if m.node.op != "reduction_max" or m.node.inputs[0] is not scores or m.node.attrs["dim"] != scores.num_dims - 1:
            return None
        covered += [x.node.index, m.node.index]
        x, subtracts_max = scores, True
    scale = 1.0
    while x.node.op == "mul_scalar":
        scale *= x.node.attrs["scalar"]
        covered.append(x.node.index)
        x = x.node.inputs[0]
    if x.node.op != "matmul":
        return None
    covered.append(x.node.index)
    q, k = x.node.inputs
    if not _batch_fits(q.dims[:-2], k.dims[:-2], v.dims[:-2]) or q.num_dims != k.num_dims or q.num_dims != v.num_dims:
        return None
    inner = set(covered) - {o.index}
    for index in inner:  # the fused kernel keeps these in registers: nothing else may read them
        if index in results or any(u not in covered for u in users[index]):
            return None
    return AttentionMatch(q.node.index, k.node.index, v.node.index, o.index, frozenset(covered), scale, subtracts_max)


def _batch_fits(q, k, v):
    """Batch dims the attention kernels take: (batch, heads) of q; k and v with the same batch and
    heads equal to q's or 1 (every query head reads the one key/value head)."""
    if len(q) > 2 or not (len(q) == len(k) == len(v)):
        return False
    if k != v:
        return False
    if len(q) == 2:
        return k[0] == q[0] and k[1] in (q[1], 1)
    return k == q


def attention_graph(graph, match, scale=None, reduce_dim=-1, subtracts_max=None):
    """A copy of ``graph`` with ``match`` replaced by what a fused kernel computes: ``softmax(scale · q k)
    v``. The keyword arguments override the match's parameters (a wrong value gives a wrong
    candidate, which verification must reject)."""
    scale = match.scale if scale is None else scale
    subtracts_max = match.subtracts_max if subtracts_max is None else subtracts_max
    out = Graph()
    copies = {}
    for node in graph.nodes:
        if node.index in match.covered and node.index != match.out:
            continue
        if node.op == "input":
            t = out.new_input(node.output.dims, node.output.dtype)
        elif node.index == match.out:
            q, k, v = copies[match.q], copies[match.k], copies[match.v]
            scores = out.matmul(q, k)
            if scale != 1.0:
                scores = out.mul_scalar(scores, scale)
            if subtracts_max:
                scores = out.sub(scores, out.reduction_max(scores, scores.num_dims - 1))
            e = out.exp(scores)
            t = out.matmul(out.div(e, out.reduction(e, reduce_dim)), v)
        else:
            args = [copies[i.node.index] for i in node.inputs]
            t = out._add(node.op, args, node.attrs, node.output.dims, node.output.dtype)
        copies[node.index] = t
    for r in graph.results():
        out.mark_output(copies[r.node.index])
    return out
