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
    (lambda: numattn.precompile("llama3-8b", gpu="sm_75"), ValueError, "gpu must be one of"),
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


@pytest.mark.ptx
def test_compiled_for_a_gpu_model_without_one(tmp_path, monkeypatch):
    """``precompile(gpu=...)`` on a machine without that GPU (here none): each workload's plans made for the
    model on shape-only operands, their kernels compiled into the kernel cache for its compute capability
    (the decode call's index check included), nothing launched; the CLI takes ``--gpu``."""
    from pathlib import Path

    from numattn.__main__ import main
    from numattn.kernels import kernel_cache

    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", str(tmp_path))
    tiny = {**TINY, "head_dim": 64, "seqlen": 128}
    report = numattn.precompile(Workload("attention", **tiny), Workload("decode", **tiny), gpu="sm_90", processes=2)
    assert [row["error"] for row in report] == [None, None]
    labels = sorted(label for _, label, _ in kernel_cache.entries(Path(tmp_path)))
    assert len(labels) == 3 and labels[0].startswith("WgmmaConfig(") and "d=64/64 causal=True" in labels[0]
    assert labels[1].startswith("decode mma") and labels[2] == "index check paged=False"
    workload = '{"op": "attention", "heads_q": 2, "heads_kv": 1, "head_dim": 64, "batch": 1, "seqlen": 128}'
    assert main(["precompile", "--workload", workload, "--processes", "1", "--gpu", "a100"]) == 0
    labels = [label for _, label, _ in kernel_cache.entries(Path(tmp_path))]
    assert len(labels) == 4 and any(label.startswith("MmaConfig(") for label in labels)  # no wgmma on sm_80
    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", "off")
    with pytest.raises(ValueError, match="NUMATTN_KERNEL_CACHE=off"):
        numattn.precompile(Workload("attention", **tiny), gpu="h100")


_FIRST_CALL = """
import json, torch, numattn
from numattn.kernels.launch import COMPILES
q, k, v = (torch.randn(1, h, 128, 64, device="cuda", dtype=torch.float16) for h in (2, 1, 1))
numattn.attention(q, k, v, causal=True)
torch.cuda.synchronize()
print(json.dumps(COMPILES))
"""


@pytest.mark.gpu
def test_kernels_compiled_for_the_model_load_on_its_gpu(tmp_path, monkeypatch):
    """A cache compiled for the present GPU's model by ``precompile(gpu=...)`` (planned without the GPU, as on
    a machine with none) serves a fresh process on the GPU: its first call compiles nothing."""
    import json
    import os
    import subprocess
    import sys

    from numattn.kernels.launch import GPUS, device_limits

    present = device_limits(0)
    model = next((name for name, gpu in GPUS.items() if gpu.name == present["name"]), None)
    if model is None:
        pytest.skip(f"no model in numattn.kernels.launch.GPUS is this GPU ({present['name']})")
    gpu = GPUS[model]
    assert (gpu.cc, gpu.sms, gpu.max_shared) == (present["cc"], present["sms"], present["max_shared"])
    assert abs(gpu.dram_gbs / present["dram_gbs"] - 1) < 0.01
    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", str(tmp_path))
    tiny = {**TINY, "head_dim": 64, "seqlen": 128}
    assert numattn.precompile(Workload("attention", **tiny), gpu=model, processes=1)[0]["error"] is None
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=dict(os.environ), capture_output=True, text=True,
                          timeout=600, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
