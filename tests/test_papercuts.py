"""Small fixes: lazy ``numattn.torch``, the command line's help, ``explain()``'s columns."""

import io
import subprocess
import sys

import pytest

import numattn
from numattn.search.pipeline import OptimizedGraph
from numattn.search.plans import Plan

pytestmark = pytest.mark.sim


def run_python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True).stdout


def test_numattn_torch_is_reachable_after_import_numattn_and_imported_lazily():
    assert run_python("-c", "import numattn, sys; print('torch' in sys.modules)").split() == ["False"]
    code = "import numattn, sys; numattn.torch.attention; print('torch' in sys.modules)"
    assert run_python("-c", code).split() == ["True"]


def test_command_line_help():
    assert "usage" in run_python("-m", "numattn")
    bench_help = run_python("-m", "numattn", "bench", "--help")
    assert "--training" in bench_help and "W6" not in bench_help and "W8" not in bench_help


def test_explain_columns_line_up_for_any_description_length():
    g = numattn.new_kernel_graph()
    g.mark_output(g.exp(g.new_input((2, 4), numattn.float32)))
    table = [
        {"plan": "unfused: one kernel per operation", "verified": True, "seconds": 1.5e-5, "note": "max rel. error 0"},
        {"plan": "fused " + "x" * 120, "verified": False, "seconds": None, "note": "pruned: too much shared memory"},
        {"plan": "f", "verified": True, "seconds": 12.25, "note": ""},
    ]
    out = io.StringIO()
    OptimizedGraph(g, Plan("unfused"), table).explain(file=out)
    header, *lines, winner = out.getvalue().splitlines()
    verified_end = header.index("verified") + len("verified")
    time_end = header.index("time") + len("time")
    note_start = header.index("note")
    assert header.startswith("candidate ") and note_start == time_end + 2
    assert len(lines) == len(table) and winner == "winner: unfused: one kernel per operation"
    for line, row in zip(lines, table, strict=True):
        assert line.startswith(row["plan"] + " ")
        assert line[:verified_end].endswith(" yes" if row["verified"] else " no")
        assert line[:time_end].endswith(" us" if row["seconds"] is not None else " -")
        assert line[note_start:] == row["note"]
