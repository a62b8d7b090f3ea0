"""numattn.precompile and ``python -m numattn precompile``: workloads, presets, worker processes, errors.
(On a GPU the workers fill the kernel cache; here they run the calls on the CPU path or in the simulator.)"""

import pytest

import numattn
from numattn.precompile import PRESETS, Workload

pytestmark = pytest.mark.sim

TINY = {"heads_q": 2, "heads_kv": 1, "head_dim": 16, "batch": 1, "seqlen": 16, "dtype": "float16"}


def test_workloads_run_in_worker_processes_and_report_in_order():
    report = numattn.precompile(Workload("attention", **TINY), Workload("decode", **TINY), processes=2)
    assert [row["workload"] for row in report] == ["attention float16 heads 2/1, head_dim 16, causal",
                                                    "decode float16 heads 2/1, head_dim 16"]
    assert all(row["error"] is None and row["seconds"] > 0 for row in report)


def test_a_failing_workload_is_reported_and_the_others_run():
    too_wide = Workload("attention", **{**TINY, "head_dim": 512})  # above the kernels' largest head dim
    report = numattn.precompile(too_wide, Workload("attention", **TINY), processes=1)
    assert "ValueError" in report[0]["error"] and "head_dim" in report[0]["error"]
    assert report[1]["error"] is None


def test_presets_name_their_models_calls():
    llama = PRESETS["llama3-8b"]
    assert {w.op for w in llama} == {"attention", "decode", "paged_decode", "train"}
    assert all((w.heads_q, w.heads_kv, w.head_dim, w.dtype) == (32, 8, 128, "bfloat16") for w in llama)
    assert {w.op for w in PRESETS["deepseek-v3-mla"]} == {"mla_decode"}


@pytest.mark.parametrize("call, error, match", [
    (lambda: Workload("prefill", 2, 1, 16), ValueError, "op must be one of"),
    (lambda: Workload("attention", 2, 1, 16, dtype="float64"), ValueError, "dtype must be one of"),
    (lambda: Workload("attention", 3, 2, 16), ValueError, "multiple of heads_kv"),
    (lambda: Workload("attention", 2, 1, 0), ValueError, "head_dim must be a positive int"),
    (lambda: Workload("attention", 2, 1, 16.0), ValueError, "head_dim must be a positive int"),
    (lambda: numattn.precompile("llama-9"), ValueError, "unknown preset 'llama-9'"),
    (lambda: numattn.precompile(("attention", 2, 1, 16)), TypeError, "Workload objects or preset names"),
    (lambda: numattn.precompile("llama3-8b", processes=0), ValueError, "processes must be a positive int"),
])
def test_bad_arguments_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_command_line(capsys):
    from numattn.__main__ import main

    workload = '{"op": "attention", "heads_q": 2, "heads_kv": 1, "head_dim": 16, "batch": 1, "seqlen": 16}'
    assert main(["precompile", "--workload", workload, "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention bfloat16 heads 2/1, head_dim 16, causal" in out and "ok" in out and "1 workloads" in out
    with pytest.raises(SystemExit, match="--workload"):
        main(["precompile", "--workload", '{"op": "attention"}'])
    with pytest.raises(SystemExit, match="nothing to compile"):
        main(["precompile"])
