"""docs/benchmarks.md is what benchmarks/page.py generates from benchmarks/results/, short, and names workloads
by their shapes (no internal labels); every stored result says how it was run."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
RUN_FACTS = {"date", "command", "revision", "gpu", "numattn", "torch", "cuda", "numba", "numba-cuda"}


def load_generator():
    spec = importlib.util.spec_from_file_location("benchmarks_page", ROOT / "benchmarks" / "page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_is_current():
    page = load_generator()
    assert page.main(["--check"]) == 0, "docs/benchmarks.md is out of date: run python benchmarks/page.py"


def test_every_block_comes_from_a_stored_result():
    page = load_generator()
    names = re.findall(r"<!-- generated: ([\w-]+) -->", PAGE.read_text())
    assert sorted(names) == sorted(page.SOURCES)
    for source in page.SOURCES.values():
        assert (RESULTS / f"{source}.json").is_file(), source


def test_page_is_short_and_names_workloads_by_shape():
    text = PAGE.read_text()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"\bW[1-8]\b", text)


def test_stored_results_carry_their_run():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        run = json.loads(path.read_text())["run"]
        assert RUN_FACTS <= set(run), f"{path.name} lacks {sorted(RUN_FACTS - set(run))}"
        assert run["date"] and run["revision"], path.name


def test_a_run_names_the_sources_it_measured(tmp_path):
    """``run_facts`` records a digest of numattn's sources beside the git revision (a copy of a checkout can
    carry stale git metadata): the same files give the same digest, any change to one another."""
    import shutil

    import numattn
    from numattn.bench import package_digest

    copy = tmp_path / "numattn"
    shutil.copytree(Path(numattn.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = package_digest(copy)
    assert re.fullmatch(r"[0-9a-f]{16}", digest) and digest == package_digest()
    (copy / "kernels" / "launch.py").write_text((copy / "kernels" / "launch.py").read_text() + "\n")
    assert package_digest(copy) != digest


def test_the_cold_start_bench_gathers_each_kernels_compiles(monkeypatch):
    """``bench_cold_start`` runs a case with the cache empty, filled, then ``repeats`` times off, and gathers
    each kernel's compile times from every process that compiled it (a filled cache compiles nothing)."""
    from numattn import bench

    calls = []

    def fake_run(case, cache):
        calls.append(cache)
        compiled = [] if len(calls) == 2 else [("main kernel", 3.0 + len(calls))]
        if cache == "off":
            compiled.append(("small kernel", 0.25))
        return {"first_call_s": 1.0, "compiles": compiled}

    monkeypatch.setattr(bench, "cold_start_run", fake_run)
    (row,) = bench.bench_cold_start(cases=("decode fp16 D128",), repeats=3)
    assert calls[:2] == [calls[0], calls[0]] and calls[0] != "off" and calls[2:] == ["off"] * 3
    assert row["off"]["compiles"][0] == ("main kernel", 6.0) and len(row["off_again"]) == 2
    assert row["compile_s"] == {"main kernel": [4.0, 6.0, 7.0, 8.0], "small kernel": [0.25] * 3}
    assert row["kernels"] == 0  # the fake compiled nothing into the cache


def test_the_cold_start_repeats_come_from_the_command_line(monkeypatch):
    """``bench --repeats N`` reaches the bench as the cold start's count of processes with the cache off (3 by
    default); N must be at least 1."""
    from numattn import bench
    from numattn.__main__ import main

    asked = []
    monkeypatch.setattr(bench, "main", lambda args: asked.append((args.cold_start, args.repeats)) or 0)
    assert main(["bench", "--only", "--cold-start", "--repeats", "5"]) == 0
    assert main(["bench", "--only", "--cold-start"]) == 0
    assert asked == [(True, 5), (True, 3)]
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "--repeats", "0"])
