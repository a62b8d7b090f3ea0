"""The kernel graph and its superoptimizer: graph API, matching, verification, search, cache."""

import dataclasses
import json

import numpy as np
import pytest

import numattn as mi
from numattn.search.interpret import evaluate
from numattn.search.match import find_attention
from numattn.search.pipeline import random_inputs
from numattn.search.plans import Plan, Runner
from numattn.search.verify import fingerprint_check, numeric_check, to_float64
from numattn.tuning import cache


def tutorial_graph(batch=2, seqlen_q=16, head_dim=16, seqlen_kv=32, scale=None, subtract_max=False):
    """Mirage's attention tutorial (K given as (head_dim, seqlen_kv)), optionally scaled and max-subtracted."""
    g = mi.new_kernel_graph()
    Q = g.new_input(dims=(batch, seqlen_q, head_dim), dtype=mi.float16)
    K = g.new_input(dims=(batch, head_dim, seqlen_kv), dtype=mi.float16)
    V = g.new_input(dims=(batch, seqlen_kv, head_dim), dtype=mi.float16)
    A = g.matmul(Q, K)
    if scale is not None:
        A = g.mul_scalar(A, scale)
    if subtract_max:
        A = g.sub(A, g.reduction_max(A, 2))
    E = g.exp(A)
    S = g.reduction(E, 2)
    D = g.div(E, S)
    O = g.matmul(D, V)
    g.mark_output(O)
    return g


def reference_attention(q, k, v, scale=1.0):
    s = scale * np.asarray(q, np.float64) @ np.asarray(k, np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)


# -- graph API ------------------------------------------------------------------------------------
def test_graph_shapes_broadcast_and_errors_name_the_op():
    g = mi.new_kernel_graph()
    x = g.new_input((2, 8, 16), mi.float32)
    w = g.new_input((16, 4), mi.float32)
    assert g.matmul(x, w).dims == (2, 8, 4)
    assert g.add(x, g.new_input((8, 1), mi.float32)).dims == (2, 8, 16)
    assert g.reduction(x, 2).dims == (2, 8, 1) and g.reduction_max(x, -1).dims == (2, 8, 1)
    with pytest.raises(ValueError, match="matmul: inner dims differ"):
        g.matmul(x, g.new_input((8, 4), mi.float32))
    with pytest.raises(ValueError, match="add: shapes .* do not broadcast"):
        g.add(x, g.new_input((3, 16), mi.float32))
    with pytest.raises(ValueError, match="reduction: dim must be an int"):
        g.reduction(x, 3)
    with pytest.raises(TypeError, match="div: operands must share one dtype"):
        g.div(x, g.new_input((16,), mi.float16))
    with pytest.raises(TypeError, match="new_input: dtype"):
        g.new_input((4,), "float16")
    with pytest.raises(ValueError, match="new_input: dims"):
        g.new_input((0, 4))
    with pytest.raises(ValueError, match="exp: argument 0 belongs to another graph"):
        mi.new_kernel_graph().exp(x)
    with pytest.raises(TypeError, match="mul_scalar: scalar"):
        g.mul_scalar(x, float("nan"))


def test_results_default_to_sinks_and_canonical_form_ignores_identity():
    a, b = tutorial_graph(), tutorial_graph()
    assert a.digest() == b.digest()
    g = mi.new_kernel_graph()
    x = g.new_input((4, 4), mi.float32)
    s = g.square(x)
    g.exp(s)
    assert [t.node.op for t in g.results()] == ["exp"]
    assert tutorial_graph(scale=0.5).digest() != a.digest()


# -- matching and verification ----------------------------------------------------------------------
def test_matcher_finds_attention_with_scale_and_max_subtraction():
    (m,) = find_attention(tutorial_graph(scale=0.25, subtract_max=True))
    assert m.scale == 0.25 and m.subtracts_max
    g = tutorial_graph()
    g.mark_output(g.nodes[4].output)  # the normaliser S is an output too: no longer fusable
    assert find_attention(g) == []


def test_fingerprint_accepts_equal_graphs_and_rejects_wrong_candidates(rng):
    g = tutorial_graph(scale=0.125)
    (m,) = find_attention(g)
    same = Plan("fused", (m,), None, "copy")
    assert fingerprint_check(g, same.semantics(g), rng) is None
    # the max-subtracted softmax is the same function: the field's stand-in for max cancels
    with_max = Plan("fused", (m,), None, "copy", overrides={"subtracts_max": True})
    assert fingerprint_check(g, with_max.semantics(g), rng) is None
    for wrong in ({"scale": 1.0}, {"reduce_dim": 1}):
        reason = fingerprint_check(g, Plan("fused", (m,), None, "copy", overrides=wrong).semantics(g), rng)
        assert reason is not None and "differs" in reason


def test_numeric_check_rejects_a_wrong_kernel_and_accepts_the_right_one(rng):
    g = tutorial_graph(scale=0.125)
    (m,) = find_attention(g)
    draw = lambda: random_inputs(g, rng, None)  # noqa: E731
    good, _ = numeric_check(g, Runner(g, Plan("fused", (m,), None, "strided")), draw)
    assert good is None
    bad, error = numeric_check(g, Runner(g, Plan("fused", (m,), None, "strided", overrides={"scale": 1.0})), draw)
    assert bad is not None and "relative error" in bad and error > 0.02
    silent, _ = numeric_check(g, lambda arrays: [], draw)  # a candidate that returns nothing
    assert silent == "0 outputs instead of 1"


def test_unfused_plan_runs_any_graph(rng):
    g = mi.new_kernel_graph()
    x = g.new_input((3, 5, 8), mi.float32)
    w = g.new_input((8, 8), mi.float32)
    h = g.rms_norm(g.matmul(x, w))
    y = g.add(g.mul(g.silu(h), g.sqrt(g.square(h))), g.mul_scalar(g.reduction_max(h, 1), 0.5))
    g.mark_output(y)
    g.mark_output(g.div(g.exp(h), g.reduction(g.exp(h), 2)))
    arrays, exact = random_inputs(g, rng, None)
    outputs = Runner(g, Plan("unfused"))(arrays)
    for out, ref in zip(outputs, evaluate(g, exact), strict=True):
        np.testing.assert_allclose(to_float64(out), ref, rtol=1e-4, atol=1e-4)


# -- search, calls, cache ------------------------------------------------------------------------------
def test_tutorial_superoptimize_runs_and_caches(tmp_path, monkeypatch, rng, capsys):
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    g = tutorial_graph()
    opt = g.superoptimize(config="attention")
    opt.explain()
    table = capsys.readouterr().out
    assert "unfused" in table and "winner: fused attention" in table
    # every candidate was verified, or left untried because the cost model ranks it far behind
    assert all(row["verified"] or row["note"].startswith("not tried") for row in opt.table)
    assert any(row["verified"] and row["plan"] == opt.plan.describe() for row in opt.table)
    q, k, v = (rng.uniform(-1, 1, t.dims).astype(np.float16) for t in g.inputs)
    (o,) = opt(inputs=[q, k, v])
    np.testing.assert_allclose(o.astype(np.float64), reference_attention(q, k, v), atol=2e-3)
    # other shapes consistent with the graph: re-specialised; inconsistent ones: a clear error
    q2 = rng.uniform(-1, 1, (2, 5, 16)).astype(np.float16)
    (o2,) = opt(q2, k, v)
    np.testing.assert_allclose(o2.astype(np.float64), reference_attention(q2, k, v), atol=2e-3)
    with pytest.raises(ValueError, match="inconsistent with the graph"):
        opt(q, k[:, :8], v)
    with pytest.raises(TypeError, match="input 1 must have dtype float16"):
        opt(q, k.astype(np.float32), v)
    with pytest.raises(ValueError, match="3 inputs, got 2"):
        opt(q, k)
    # from the cache: the same winner, no search
    cached = tutorial_graph().superoptimize(config="attention")
    assert cached.plan == opt.plan and cached.table == opt.table


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring unreadable"):
        tutorial_graph(seqlen_q=8).superoptimize(previous_checkpoint=path)
    assert len(json.loads(path.read_text())) == 1


def test_superoptimize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="config must be one of"):
        tutorial_graph().superoptimize(config="mlp")
    with pytest.raises(ValueError, match="computes nothing"):
        g = mi.new_kernel_graph()
        g.new_input((2, 2))
        g.superoptimize()


@pytest.mark.gpu
def test_tutorial_on_gpu_with_torch(tmp_path, monkeypatch):
    """The tutorial's graph searched and run on the GPU with torch tensors: no candidate fails to launch (the
    keys read in place took too few pointers once the kernels gained ALiBi and sinks), and the winner's
    launch-only path gives the reference."""
    import torch

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    g = tutorial_graph(batch=2, seqlen_q=256, head_dim=64, seqlen_kv=4096)
    opt = g.superoptimize(config="attention", profile_iters=50)
    # every candidate tried ran (a plan whose launch fails would only lose the search, silently)
    assert not [row for row in opt.table if row["note"].startswith("failed to run")]
    q, k, v = (torch.rand(t.dims, device="cuda", dtype=torch.float16) * 2 - 1 for t in g.inputs)
    ref = reference_attention(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy())
    for _ in range(2):  # the first call validates the inputs, the second takes the launch-only path
        (o,) = opt(inputs=[q, k, v])
        assert np.abs(o.double().cpu().numpy() - ref).max() < 2e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_key_split_attention_plans_match_reference(rng, causal, transposed):
    """The mma.sync kernel over runs of keys, merged by each query tile's last block (a search candidate), with
    K stored as rows of keys or transposed (keys contiguous, read by runs of 8 keys: 75 keys end mid-run); five
    splits take the merge's rounds of four splits twice."""
    from numattn.configs.attention import MmaConfig
    from numattn.ops.attention import make_plan, validate

    q = rng.uniform(-1, 1, (1, 2, 20, 32)).astype(np.float16)
    if transposed:
        k = np.swapaxes(rng.uniform(-1, 1, (1, 1, 32, 80)).astype(np.float16), 2, 3)[:, :, :75]
    else:
        k = rng.uniform(-1, 1, (1, 1, 75, 32)).astype(np.float16)
    v = rng.uniform(-1, 1, (1, 1, 75, 16)).astype(np.float16)
    config = MmaConfig(block_n=16, num_warps=1)
    for splits in (1, 3, 5):  # 5 key tiles: one run; runs of 2, 2 and 1 tiles; a tile each
        problem = validate(q, k, v, None, causal, 0.3, "bhsd", True)
        assert problem.transposed_k_loads == transposed
        o, lse = make_plan(problem, config, splits)(q, k, v, None)
        ref_o, ref_lse = mi.reference.attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
        np.testing.assert_allclose(o.astype(np.float64), ref_o, atol=2e-3)
        finite = np.isfinite(ref_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)


def test_tune_stores_a_configuration_that_attention_then_uses(tmp_path, monkeypatch, rng):
    from numattn.ops import attention as attention_module
    from numattn.tuning.store import problem_key

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q = rng.uniform(-1, 1, (1, 2, 24, 32)).astype(np.float16)
    k = rng.uniform(-1, 1, (1, 1, 70, 32)).astype(np.float16)
    v = rng.uniform(-1, 1, (1, 1, 70, 32)).astype(np.float16)
    table = mi.tune(q, k, v, causal=True, scale=0.2)
    assert any(row["verified"] for row in table)
    problem = attention_module.validate(q, k, v, None, True, 0.2, "bhsd", False)
    stored = cache.load(str(tmp_path / "superoptimize.json"), problem_key("attention", problem))
    fastest = min((row for row in table if row["verified"]), key=lambda row: row["seconds"])
    assert (repr(stored["config"]), stored["splits"]) == (fastest["config"], fastest["splits"])
    plan = attention_module._tuned_or_default_plan(problem)  # built from the stored configuration
    assert (plan.config, plan.splits) == (stored["config"], stored["splits"])
    o = mi.attention(q, k, v, causal=True, scale=0.2)
    np.testing.assert_allclose(o.astype(np.float64), mi.reference.attention(q, k, v, causal=True, scale=0.2), atol=2e-3)


@pytest.mark.gpu
def test_tune_on_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q, k, v = (torch.rand(shape, device="cuda", dtype=torch.bfloat16) - 0.5
               for shape in [(2, 4, 200, 64), (2, 2, 1000, 64), (2, 2, 1000, 64)])
    table = mi.tune(q, k, v, causal=True, profile_iters=20)
    assert sum(row["verified"] for row in table) >= 2 and all(row["seconds"] for row in table if row["verified"])
    o = mi.attention(q, k, v, causal=True)
    ref = mi.reference.attention(q, k, v, causal=True)
    assert np.abs(o.double().cpu().numpy() - ref).max() < 1.6e-2


@pytest.mark.gpu
def test_unfused_plan_on_gpu_with_torch(rng):
    import torch

    g = mi.new_kernel_graph()
    x = g.new_input((4, 8, 32), mi.bfloat16)
    g.mark_output(g.silu(g.rms_norm(x)))
    arrays, exact = random_inputs(g, rng, 0)
    (out,) = Runner(g, Plan("unfused"))(arrays)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    np.testing.assert_allclose(to_float64(out), evaluate(g, exact)[0], atol=3e-2)


def test_partial_fusion_runs_unfused_operations_around_the_fused_attention(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    g = mi.new_kernel_graph()
    X = g.new_input((2, 8, 16), mi.float16)
    K = g.new_input((2, 16, 24), mi.float16)
    V = g.new_input((2, 24, 16), mi.float16)
    A = g.mul_scalar(g.matmul(g.rms_norm(X), K), 0.25)
    E = g.exp(g.sub(A, g.reduction_max(A, 2)))
    g.mark_output(g.mul_scalar(g.matmul(g.div(E, g.reduction(E, 2)), V), 2.0))
    (match,) = find_attention(g)
    assert match.subtracts_max and match.scale == 0.25 and g.nodes[match.q].op == "rms_norm"
    opt = g.superoptimize()
    assert opt.plan.kind == "fused"
    arrays, exact = random_inputs(g, rng, None)
    (out,) = opt(*arrays)
    np.testing.assert_allclose(to_float64(out), evaluate(g, exact)[0], atol=5e-3)


def test_tune_decode_and_mla_decode(tmp_path, monkeypatch, rng):
    """numattn.tune(fn, ...) for the decode functions: the stored splits (and MLA configuration) are what
    later calls plan with, and their results stay correct."""
    from numattn.ops import decode as decode_module
    from numattn.ops import mla as mla_module
    from numattn.tuning.store import tuned_config

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q = rng.uniform(-1, 1, (1, 4, 1, 16)).astype(np.float16)
    k = rng.uniform(-1, 1, (1, 2, 128, 16)).astype(np.float16)
    v = rng.uniform(-1, 1, (1, 2, 128, 16)).astype(np.float16)
    table = mi.tune(mi.decode, q, k, v, scale=0.3)
    assert {row["splits"] for row in table} == {1, 2, 4}  # 128 keys: runs of at least 32 and all(row["verified"] for row in table)
    problem = decode_module.validate_decode_args(q, k, v, None, None, 0.3, "bhsd", False)
    fastest = min(table, key=lambda row: row["seconds"])
    assert tuned_config("decode", problem, decode_module.tuning_options) == (None, fastest["splits"])
    np.testing.assert_allclose(mi.decode(q, k, v, scale=0.3).astype(np.float64),
                               mi.reference.attention(q, k, v, scale=0.3), atol=2e-3)

    q_nope, q_pe = rng.uniform(-1, 1, (2, 16, 64)).astype(np.float16), rng.uniform(-1, 1, (2, 16, 16)).astype(np.float16)
    ckv, kpe = rng.uniform(-1, 1, (12, 8, 64)).astype(np.float16), rng.uniform(-1, 1, (12, 8, 16)).astype(np.float16)
    pages = rng.permutation(12)[:10].reshape(2, 5).astype(np.int32)
    lengths = np.array([37, 40], np.int32)
    args = (q_nope, q_pe, ckv, kpe, pages, lengths)
    table = mi.tune(mi.mla_decode, *args, scale=0.2)
    assert any(row["verified"] for row in table)
    problem = mla_module.validate(*args, 0.2, False)
    fastest = min((row for row in table if row["verified"]), key=lambda row: row["seconds"])
    config, splits = tuned_config("mla_decode", problem, mla_module.tuning_options)
    assert (repr(config), splits) == (fastest["config"], fastest["splits"])
    np.testing.assert_allclose(mi.mla_decode(*args, scale=0.2).astype(np.float64),
                               mi.reference.mla_decode(*args, scale=0.2), atol=2e-3)
    with pytest.raises(TypeError, match="tune takes numattn.attention"):
        mi.tune(print, q)


def test_tune_takes_the_score_options_and_keys_their_configurations_apart(tmp_path, monkeypatch, rng):
    """numattn.tune takes attention's and decode's score options (window, softcap, ALiBi, sinks); what it
    stores for a call with them is found by that call and not by the same shapes without them."""
    from numattn.ops import attention as attention_module
    from numattn.ops import decode as decode_module
    from numattn.tuning.store import tuned_config

    def halves(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float16)

    def per_head(heads):
        return rng.uniform(-1, 1, heads).astype(np.float32), rng.uniform(0.1, 0.5, heads).astype(np.float32)

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q, k, v = halves(1, 2, 24, 32), halves(1, 1, 70, 32), halves(1, 1, 70, 32)
    sinks, slopes = per_head(2)
    options = {"window": (16, 0), "softcap": 5.0, "alibi_slopes": slopes, "sinks": sinks}
    table = mi.tune(q, k, v, causal=True, scale=0.2, **options)
    assert any(row["verified"] for row in table)
    with_options = attention_module.validate(q, k, v, None, True, 0.2, "bhsd", False, *options.values())
    plain = attention_module.validate(q, k, v, None, True, 0.2, "bhsd", False)
    assert tuned_config("attention", with_options, attention_module.tuning_options) is not None
    assert tuned_config("attention", plain, attention_module.tuning_options) is None
    np.testing.assert_allclose(mi.attention(q, k, v, causal=True, scale=0.2, **options).astype(np.float64),
                               mi.reference.attention(q, k, v, causal=True, scale=0.2, **options), atol=2e-3)

    q, k, v = halves(1, 4, 1, 16), halves(1, 2, 128, 16), halves(1, 2, 128, 16)
    sinks, slopes = per_head(4)
    options = {"window": (40, 0), "softcap": 5.0, "alibi_slopes": slopes, "sinks": sinks}
    table = mi.tune(mi.decode, q, k, v, scale=0.3, **options)
    assert all(row["verified"] for row in table)
    with_options = decode_module.validate_decode_args(q, k, v, None, None, 0.3, "bhsd", False, None, *options.values())
    plain = decode_module.validate_decode_args(q, k, v, None, None, 0.3, "bhsd", False)
    fastest = min(table, key=lambda row: row["seconds"])
    assert tuned_config("decode", with_options, decode_module.tuning_options) == (None, fastest["splits"])
    assert tuned_config("decode", plain, decode_module.tuning_options) is None
    np.testing.assert_allclose(mi.decode(q, k, v, scale=0.3, **options).astype(np.float64),
                               mi.reference.attention(q, k, v, scale=0.3, **options), atol=2e-3)


def test_tune_checks_the_lengths_as_a_call_does(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q = rng.uniform(-1, 1, (1, 4, 16)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (1, 2, 8, 16)).astype(np.float32) for _ in range(2))
    for lengths, match in (([100], r"seqlens\[0\] = 100 exceeds the cache length \(8\)"),
                           ([-5], r"seqlens must be non-negative, got seqlens\[0\] = -5")):
        with pytest.raises(ValueError, match=match):
            mi.tune(mi.decode, q, k, v, seqlens=np.array(lengths, np.int32))


def test_mla_tuning_candidates_hold_the_default(rng):
    """Tuning mla_decode also tries the default's persistent grid (on sm_90, the simulator's), without key
    splits only, where it takes the heads (at most 32); the other candidates with the split counts."""
    from numattn.configs.mla import mla_default_config
    from numattn.search.functional import _mla_candidates

    def halves(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float16)

    for heads in (32, 64):
        args = (halves(8, heads, 128), halves(8, heads, 16), halves(64, 16, 128), halves(64, 16, 16),
                rng.permutation(64).astype(np.int32).reshape(8, 8), np.full(8, 128, np.int32))
        _, problem, candidates, _ = _mla_candidates(*args, scale=0.1)
        default = mla_default_config(128, 16, (9, 0))
        persistent = [(config, splits) for config, splits, _ in candidates if config.persistent]
        assert persistent == ([(dataclasses.replace(default, persistent=True), 1)] if heads <= 32 else [])
        assert {splits for config, splits, _ in candidates if not config.persistent} >= {1, 2}


@pytest.mark.gpu
def test_tune_decode_and_mla_decode_on_gpu(tmp_path, monkeypatch, fresh_plans):
    """On the GPU, tuning times the candidates with CUDA events; the stored choice is what later calls use.
    (MLA's candidates narrowed to the two sm_90 block_n 64 schedules: each configuration compiles for a while.)"""
    import torch

    from numattn.ops import decode as decode_module
    from numattn.ops import mla as mla_module
    from numattn.tuning.store import tuned_config

    monkeypatch.setenv("NUMATTN_CACHE_DIR", str(tmp_path))
    q = torch.rand(2, 8, 128, device="cuda", dtype=torch.float16) - 0.5
    k, v = (torch.rand(2, 2, 3000, 128, device="cuda", dtype=torch.float16) - 0.5 for _ in range(2))
    table = mi.tune(mi.decode, q, k, v, profile_iters=20)
    assert len(table) >= 3 and all(row["verified"] and row["seconds"] > 0 for row in table)
    fastest = min(table, key=lambda row: row["seconds"])
    problem = decode_module.validate_decode_args(q, k, v, None, None, None, "bhsd", False)
    assert tuned_config("decode", problem, decode_module.tuning_options) == (None, fastest["splits"])
    fresh_plans.clear()
    o = mi.decode(q, k, v)
    assert [plan.splits for key, plan in fresh_plans.items() if key[0] == "decode"] == [fastest["splits"]]
    assert np.abs(o.double().cpu().numpy() - mi.reference.decode(q, k, v)).max() < 2e-3

    batch, heads, rank, rope, pages = 2, 16, 512, 64, 700
    q_nope, q_pe = (torch.rand(batch, heads, d, device="cuda", dtype=torch.float16) - 0.5 for d in (rank, rope))
    ckv, kpe = (torch.rand(pages, 1, d, device="cuda", dtype=torch.float16) - 0.5 for d in (rank, rope))
    table_pages = torch.randperm(pages, device="cuda")[:600].reshape(batch, 300).int()
    lengths = torch.tensor([300, 211], device="cuda", dtype=torch.int32)
    args = (q_nope, q_pe, ckv, kpe, table_pages, lengths)
    every = mla_module.mla_candidates
    monkeypatch.setattr(mla_module, "mla_candidates", lambda *a: [c for c in every(*a) if c.block_n == 64])
    table = mi.tune(mi.mla_decode, *args, scale=0.1, profile_iters=20)
    verified = [row for row in table if row["verified"]]
    assert len(verified) >= 2 and all(row["seconds"] > 0 for row in verified)
    fastest = min(verified, key=lambda row: row["seconds"])
    config, splits = tuned_config("mla_decode", mla_module.validate(*args, 0.1, False), mla_module.tuning_options)
    assert (repr(config), splits) == (fastest["config"], fastest["splits"])
    fresh_plans.clear()
    o = mi.mla_decode(*args, scale=0.1)
    assert [(plan.config, plan.splits) for key, plan in fresh_plans.items() if key[0] == "mla_decode"] == [
        (config, splits)]
    assert np.abs(o.double().cpu().numpy() - mi.reference.mla_decode(*args, scale=0.1)).max() < 2e-3


def test_configurations_that_would_spill_are_pruned_before_compiling():
    """Register pressure against ptxas's counts (sm_90, fp16, 2026-11-23): configurations that compiled
    without spilling fit; those that spilled are pruned with the reason; the heuristics pick neither
    a configuration that spills nor one beyond the shared memory of sm_80, sm_86 or sm_90."""
    from numattn.configs.attention import MmaConfig, WgmmaConfig, choose_mma_config, choose_wgmma_config, misfit
    from numattn.kernels.launch import device_limits
    from numattn.ops.attention import validate

    def problem(head_dim):
        x = np.ones((1, 1, 16, head_dim), np.float16)
        return validate(x, x, x, None, False, None, "bhsd", False)

    limits = device_limits(0)
    no_spill = [(MmaConfig(32, 4, 2, False), 128), (MmaConfig(64, 4, 1, False), 256), (MmaConfig(64, 4, 2, True), 64),
                (WgmmaConfig(64, 3, 4), 128), (WgmmaConfig(96, 3, 3), 64), (WgmmaConfig(32, 2, 3), 256)]
    spilled = [(MmaConfig(64, 4, 1, True), 256, 168), (MmaConfig(64, 4, 2, True), 128, 620),
               (MmaConfig(32, 4, 4, False), 64, 156), (WgmmaConfig(128, 3, 3), 64, 52),
               (WgmmaConfig(96, 3, 3), 128, 64), (WgmmaConfig(32, 3, 3), 256, 336)]
    for config, head_dim in no_spill:
        assert misfit(problem(head_dim), config, limits) is None, (config, head_dim)
    for config, head_dim, spill_bytes in spilled:
        reason = misfit(problem(head_dim), config, limits)
        assert reason is not None and reason.startswith("register pressure"), (config, head_dim, spill_bytes)
    assert "shared memory" in misfit(problem(256), WgmmaConfig(128, 2, 4), limits)

    for shared in (99 * 1024, 163 * 1024, 227 * 1024):
        for head_dim in range(16, 257, 16):
            config = choose_mma_config(head_dim, head_dim, shared)
            assert config.register_pressure(head_dim, head_dim) <= config.register_pressure_limit
            assert config.shared_bytes(head_dim, head_dim) <= shared or config == MmaConfig(16, 1)
        for head_dim in (64, 128, 192, 256):
            config = choose_wgmma_config(head_dim, head_dim, shared)
            if config.shared_bytes(head_dim, head_dim) <= shared:
                assert config.register_pressure(head_dim, head_dim) <= config.register_pressure_limit
