"""The seed tutorials as their authors wrote them, with only the import line changed, run end to end.

The texts are the code blocks of Mirage's and YiRage's "Superoptimizing Group-Query Attention"
tutorials (docs/source/tutorials/group-query-attention.rst of mirage-project/mirage and of the
yica-yirage 0.3.1 package). On a machine without a GPU there is no ``cuda:0`` to put the tutorial's
``torch.randn`` tensors on: the one substitution made there is ``device='cuda:0'`` → ``device='cpu'``,
and the graph runs on the CPU path.
"""

import contextlib

import pytest
import torch

import numattn

from helpers import max_error

pytestmark = pytest.mark.sim

MIRAGE_GQA = """\
import numattn as mi
graph = mi.new_kernel_graph()
Q = graph.new_input(dims=(2, 256, 64), dtype=mi.float16)
K = graph.new_input(dims=(2, 64, 4096), dtype=mi.float16)
V = graph.new_input(dims=(2, 4096, 64), dtype=mi.float16)
A = graph.matmul(Q, K)
E = graph.exp(A)
S = graph.reduction(E, 2)
D = graph.div(E, S)
O = graph.matmul(D, V)
optimized_graph = graph.superoptimize(config="attention")

import torch
input_tensors = [
    torch.randn(64, 1, 128, dtype=torch.float16, device='cuda:0'),
    torch.randn(64, 128, 4096, dtype=torch.float16, device='cuda:0'),
    torch.randn(64, 4096, 128, dtype=torch.float16, device='cuda:0')
]
# Launch the Mirage-generated kernel to perform attention
output = optimized_graph(input_tensors)
"""

YIRAGE_GQA = """\
import numattn as yr
graph = yr.new_kernel_graph()
Q = graph.new_input(dims=(2, 256, 64), dtype=yr.float16)
K = graph.new_input(dims=(2, 64, 4096), dtype=yr.float16)
V = graph.new_input(dims=(2, 4096, 64), dtype=yr.float16)
A = graph.matmul(Q, K)
E = graph.exp(A)
S = graph.reduction(E, 2)
D = graph.div(E, S)
O = graph.matmul(D, V)
optimized_graph = graph.superoptimize(config="attention")

import torch
input_tensors = [
    torch.randn(64, 1, 128, dtype=torch.float16, device='cuda:0'),
    torch.randn(64, 128, 4096, dtype=torch.float16, device='cuda:0'),
    torch.randn(64, 4096, 128, dtype=torch.float16, device='cuda:0')
]
# Launch the YiRage-generated kernel to perform attention
output = optimized_graph(input_tensors)
"""

# Mirage's later revision of the same tutorial: the module-level superoptimize, an explicit output
MIRAGE_GQA_LATER = """\
import torch
import numattn as mi
graph = mi.new_kernel_graph()
Q = graph.new_input(dims=(2, 256, 64), dtype=mi.float16)
K = graph.new_input(dims=(2, 64, 4096), dtype=mi.float16)
V = graph.new_input(dims=(2, 4096, 64), dtype=mi.float16)
A = graph.matmul(Q, K)
E = graph.exp(A)
S = graph.reduction(E, 2)
D = graph.div(E, S)
O = graph.matmul(D, V)
graph.mark_output(O)
optimized_graph = mi.superoptimize(graph)
"""


def _softmax_attention(q, k, v):
    """float64 ``softmax(q @ k) @ v`` over the last axis (the tutorial's graph, max-subtracted)."""
    s = q.double() @ k.double()
    return torch.softmax(s, dim=-1) @ v.double()


@pytest.fixture(autouse=True)
def host_path(tmp_path, monkeypatch):
    """A fresh tuning cache; without a GPU, the CPU path (not the simulator the other tests use)."""
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    with numattn.simulate(False) if numattn.SIMULATOR else contextlib.nullcontext():
        yield


def _run(text):
    if numattn.SIMULATOR:
        text = text.replace("device='cuda:0'", "device='cpu'")
    namespace = {"__name__": "__seed__"}
    exec(compile(text, "<seed tutorial>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("text", [MIRAGE_GQA, YIRAGE_GQA], ids=["mirage", "yirage"])
def test_gqa_tutorial_as_written(text):
    namespace = _run(text)
    (output,) = namespace["output"]
    q, k, v = namespace["input_tensors"]
    assert output.shape == (64, 1, 128) and output.dtype == torch.float16
    expected = _softmax_attention(q, k, v).cpu().numpy()  # randn scores reach |s| ≈ 50: exp(s) overflows
    assert max_error(output.cpu(), expected, rounded_to="float16") < 2e-3


def test_gqa_tutorial_later_revision():
    namespace = _run(MIRAGE_GQA_LATER)
    optimized = namespace["optimized_graph"]
    q, k, v = (torch.rand(t.dims, dtype=torch.float16) * 2 - 1 for t in namespace["graph"].inputs)
    (output,) = optimized([q, k, v])
    assert max_error(output, _softmax_attention(q, k, v).numpy(), rounded_to="float16") < 2e-3
