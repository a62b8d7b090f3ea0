"""The tuning cache on disk: unwritable directories, concurrent writers, invalid entries."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import numattn as mi
from numattn.kernels.launch import device_limits
from numattn.search.plans import Plan
from numattn.tuning import cache
from numattn.tuning.store import problem_key, tuned_config

from test_search import tutorial_graph

pytestmark = pytest.mark.sim


def write_entry(path, key, config=None, **plan):
    """Write a cache file by hand: ``key``'s entry as ``cache.store`` writes it, an unsplit fused plan with
    ``config`` (a ``{"type", "fields"}`` dict), with the plan's fields replaced by ``plan``'s."""
    fields = {"kind": "fused", "config": config, "k_layout": "copy", "splits": 1, **plan}
    path.write_text(json.dumps({key: {"plan": fields, "table": []}}))


def simt(**fields):
    return {"type": "SimtConfig", "fields": {"block_m": 16, "block_n": 16, "num_threads": 8, "threads_n": 2, **fields}}


def mma(**fields):
    return {"type": "MmaConfig",
            "fields": {"block_n": 16, "num_warps": 1, "warp_m": 1, "q_in_registers": True, "stages": 2, **fields}}


def attention_inputs(rng):
    return tuple(rng.uniform(-1, 1, (1, 2, 8, 16)).astype(np.float32) for _ in range(3))


# -- unwritable directories -------------------------------------------------------------------------
def test_search_and_tune_warn_and_return_when_the_cache_directory_is_a_file(tmp_path, monkeypatch, rng):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "cache.json"
    with pytest.warns(cache.CacheWarning) as record:
        opt = tutorial_graph(seqlen_q=8).superoptimize(previous_checkpoint=path)
    assert [str(w.message).split(": [Errno")[0] for w in record] == [
        f"ignoring unreadable numattn tuning cache {path}", f"could not write the numattn tuning cache {path}"]
    assert opt.plan.kind == "fused"
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(blocker / "sub"))
    q, k, v = attention_inputs(rng)
    with pytest.warns(cache.CacheWarning, match="could not write the numattn tuning cache .*Not a directory"):
        table = mi.tune(q, k, v)
    assert any(row["verified"] for row in table)


def test_tune_warns_and_returns_when_the_cache_file_cannot_be_replaced(tmp_path, monkeypatch, rng):
    """A directory without write permission (simulated: root writes anyway) refuses the rename."""
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    path = cache.cache_path()
    replace = os.replace

    def refuse(src, dst):
        if os.fspath(dst) == path:
            raise PermissionError(13, "Permission denied", dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.warns(cache.CacheWarning, match=f"could not write the numattn tuning cache {path}: .*Permission"):
        table = mi.tune(*attention_inputs(rng))
    assert any(row["verified"] for row in table)
    assert sorted(os.listdir(tmp_path)) == [cache.FILE_NAME + ".lock"]  # no temporary file left behind


# -- concurrent writers, file mode --------------------------------------------------------------------
_WRITER = """
import os, sys, time
from numattn.tuning import cache
from numattn.search.plans import Plan

path, directory, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(os.path.join(directory, f"ready-{first}"), "w").close()
while not os.path.exists(os.path.join(directory, "go")):
    time.sleep(0.001)
for i in range(first, first + 50):
    cache.store(path, f"key-{i}", Plan("unfused"), [{"plan": "unfused", "verified": True, "seconds": 1e-6, "note": ""}])
"""


def test_concurrent_stores_keep_every_entry_and_the_file_mode(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text("{}")
    path.chmod(0o640)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(tmp_path), str(first)])
               for first in range(0, 200, 50)]
    deadline = time.monotonic() + 60
    while sum(name.startswith("ready-") for name in os.listdir(tmp_path)) < len(writers):
        assert time.monotonic() < deadline and all(w.poll() is None for w in writers), "a writer did not start"
        time.sleep(0.01)
    (tmp_path / "go").touch()  # all at once
    assert [w.wait(60) for w in writers] == [0] * len(writers)
    assert sorted(json.loads(path.read_text())) == sorted(f"key-{i}" for i in range(200))
    assert path.stat().st_mode & 0o7777 == 0o640


def test_a_new_cache_file_gets_the_mode_open_gives(tmp_path):
    path = tmp_path / "new" / "cache.json"
    umask = os.umask(0o027)
    try:
        cache.store(path, "key", Plan("unfused"), [])
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o7777 == 0o640
    assert cache.load(path, "key")["kind"] == "unfused"


# -- invalid entries ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config, plan, expected", [
    (None, {"splits": 999}, "splits must be an int in \\[1, 64\\], got 999"),
    (None, {"splits": 0}, "splits must be an int in \\[1, 64\\], got 0"),
    (None, {"splits": -3}, "splits must be an int"),
    (None, {"splits": "2"}, "splits must be an int"),
    (None, {"splits": True}, "splits must be an int"),
    (None, {"kind": "fast"}, "kind must be 'fused' or 'unfused', got 'fast'"),
    (None, {"k_layout": ["copy"]}, "k_layout must be 'copy' or 'strided'"),
    (simt(block_m=0), {}, "SimtConfig field block_m must be a positive int, got 0"),
    (simt(threads_n=0), {}, "SimtConfig field threads_n must be a positive int, got 0"),
    (simt(block_n=4.0), {}, "SimtConfig field block_n must be a positive int, got 4.0"),
    (simt(block_m=10), {}, "inconsistent SIMT tile configuration"),
    (mma(block_n=-16), {}, "MmaConfig field block_n must be a positive int, got -16"),
    (mma(q_in_registers=1), {}, "MmaConfig field q_in_registers must be a bool, got 1"),
    (mma(stages=9), {}, "inconsistent tensor-core tile configuration"),
    ({"type": "MmaConfig", "fields": {"block_n": 16}}, {}, "MmaConfig fields must be block_n, num_warps"),
    ({"type": "FastConfig", "fields": {}}, {}, "config type must be one of MmaConfig, .*got 'FastConfig'"),
    ({"type": "MlaConfig", "fields": {"block_n": 16, "stages": 2, "warps": 4, "qk": 7, "wgmma": False,
                                      "persistent": False}}, {}, "MlaConfig field qk must be a str, got 7"),
    ("MmaConfig", {}, "config must be null or an object"),
])
def test_invalid_entries_are_ignored_with_a_warning(tmp_path, config, plan, expected):
    path = tmp_path / "cache.json"
    write_entry(path, "key", config, **plan)
    with pytest.warns(cache.CacheWarning, match=f"invalid numattn tuning cache entry in {path}: {expected}"):
        assert cache.load(path, "key") is None


def test_an_invalid_table_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"key": {"plan": {"kind": "unfused", "config": None, "k_layout": "copy", "splits": 1},
                                        "table": [3]}}))
    with pytest.warns(cache.CacheWarning, match=r"table must be a list of objects, got \[3\]"):
        assert cache.load(path, "key") is None


def test_superoptimize_searches_again_past_an_invalid_entry(tmp_path):
    path = tmp_path / "cache.json"
    graph = tutorial_graph(seqlen_q=8)
    key = cache.cache_key(graph, device_limits(0), mi.__version__)
    write_entry(path, key, mma(), splits=999)
    with pytest.warns(cache.CacheWarning, match="splits must be"):
        opt = graph.superoptimize(previous_checkpoint=path)
    assert opt.plan.splits <= 64 and cache.load(path, key)["splits"] == opt.plan.splits  # replaced
    q, k, v = (np.ones(t.dims, np.float16) for t in graph.inputs)
    np.testing.assert_allclose(opt(q, k, v)[0].astype(np.float64), 1.0)


@pytest.mark.parametrize("config, splits", [(simt(block_m=0), 1), (simt(), 999), (simt(), -3),
                                            (mma(), 1),  # valid, but not a configuration of a float32 problem
                                            (simt(), 2)])  # the SIMT kernel takes no key splits
def test_attention_falls_back_to_its_heuristic_past_an_invalid_entry(tmp_path, monkeypatch, rng, fresh_plans,
                                                                      config, splits):
    from numattn.ops.attention import validate

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q, k, v = attention_inputs(rng)
    problem = validate(q, k, v, None, False, None, "bhsd", False)
    write_entry(tmp_path / cache.FILE_NAME, problem_key("attention", problem), config, splits=splits)
    with pytest.warns(cache.CacheWarning, match=f"numattn tuning cache entry in {tmp_path}"):
        o = mi.attention(q, k, v)
    np.testing.assert_allclose(o, mi.reference.attention(q, k, v), atol=2e-5)


@pytest.mark.parametrize("splits", [-3, 0, 999, 64])  # 64: in range, but more splits than tune tries for 32 keys
def test_decode_falls_back_to_its_heuristic_past_an_invalid_entry(tmp_path, monkeypatch, rng, fresh_plans, splits):
    from numattn.ops.decode import validate_decode_args

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q = rng.uniform(-1, 1, (1, 4, 1, 16)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (1, 2, 32, 16)).astype(np.float32) for _ in range(2))
    problem = validate_decode_args(q, k, v, None, None, 0.3, "bhsd", False)
    write_entry(tmp_path / cache.FILE_NAME, problem_key("decode", problem), splits=splits)
    with pytest.warns(cache.CacheWarning, match=f"numattn tuning cache entry in {tmp_path}"):
        o = mi.decode(q, k, v, scale=0.3)
    np.testing.assert_allclose(o, mi.reference.attention(q, k, v, scale=0.3), atol=2e-5)


def test_mla_decode_falls_back_to_its_default_past_a_configuration_that_does_not_fit(tmp_path, monkeypatch, rng,
                                                                                   fresh_plans):
    from numattn.ops.mla import tuning_options, validate

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q_nope, q_pe, ckv, kpe = (rng.uniform(-1, 1, shape).astype(np.float16)
                              for shape in [(1, 16, 64), (1, 16, 16), (2, 8, 64), (2, 8, 16)])
    args = (q_nope, q_pe, ckv, kpe, np.array([[0, 1]], np.int32), np.array([13], np.int32))
    problem = validate(*args, 0.2, False)
    three_warps = {"type": "MlaConfig", "fields": {"block_n": 16, "stages": 2, "warps": 3, "qk": "duplicated",
                                                   "wgmma": False, "persistent": False}}  # 64 columns: not in 3 warps
    write_entry(tmp_path / cache.FILE_NAME, problem_key("mla_decode", problem), three_warps)
    with pytest.warns(cache.CacheWarning, match="not one that numattn.tune tries"):
        assert tuned_config("mla_decode", problem, tuning_options) is None
    o = mi.mla_decode(*args, scale=0.2)
    np.testing.assert_allclose(o.astype(np.float64), mi.reference.mla_decode(*args, scale=0.2), atol=2e-3)


def test_entries_are_keyed_by_the_kernel_sources(monkeypatch, rng):
    """A configuration tuned for other kernels is not reused: the problem key digests the kernel sources."""
    from numattn.ops.attention import validate
    from numattn.tuning import store

    q = rng.uniform(-1, 1, (1, 2, 24, 32)).astype(np.float16)
    problem = validate(q, q, q, None, False, 0.2, "bhsd", False)
    before = problem_key("attention", problem)
    monkeypatch.setattr(store, "source_digest", lambda: "other kernels")
    assert problem_key("attention", problem) != before
