"""Attention variants on one GPU: numattn's sliding window, softcap, ALiBi and sinks against FlexAttention.

    python benchmarks/variants.py [--json PATH] [--no-flex] [--training] [--passes N]

Forward passes, bf16, default arguments, on fresh random inputs; each timed as the median of CUDA-event
timings with the L2 cache flushed. A case's contenders are timed in turns over seven rounds, one case after
the other, so that the two sides of a ratio meet the GPU in the same state: a short kernel timed right after
long runs of heavy ones was seen to take up to 18% longer. The cases are passed over ``--passes`` times
(three), the GPU's clocks warmed before each pass; a ratio is the median of the passes' ratios, a time the
median of the passes' times.

* Window scaling: B1 H16 L32768 D128, causal against causal with a window of 4096 keys to the left; the
  window's time over the causal time, against the fraction of (query, key) pairs it keeps visible (the
  target: at most 1.15 times that fraction).
* Against FlexAttention (``torch.compile(flex_attention)`` with a block mask, same shapes) at
  B4 H16 L8192 D128: causal; causal with a window of 1024; causal with softcap 30; causal with ALiBi;
  causal with sinks (numattn only: FlexAttention has no sinks). The best SDPA backend's causal time
  (cuDNN included) is given for scale.
* ``--training``: the same comparison for a training step, ``numattn.torch.attention`` forward and
  backward (gradients of q, k and v) against FlexAttention's, five rounds.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def rows_of_pairs(seqlen, left):
    """The (query, key) pairs a causal window of ``left`` keys keeps visible, over those of causal masking."""
    visible = sum(min(i, left) + 1 for i in range(seqlen))
    return visible / (seqlen * (seqlen + 1) / 2)


def timed_in_turns(torch, calls, rounds=5, warm=True):
    """``{name: median ms}`` of ``cuda_time_ms`` of each of ``calls``, the calls taking turns round by round, in
    the reverse order every other round; first, with ``warm``, the GPU's clocks are warmed."""
    from numattn.bench import cuda_time_ms, warm_clocks

    if warm:
        warm_clocks(torch, 2.0)
    times = {name: [] for name in calls}
    for round_ in range(rounds):
        for name, call in list(calls.items())[::-1 if round_ % 2 else 1]:
            times[name].append(cuda_time_ms(call, repeat=10))
    return {name: statistics.median(ts) for name, ts in times.items()}


def timed_case_by_case(torch, cases, passes, rounds=7):
    """``{(case, contender): [median ms of each pass]}``: ``cases`` maps a case to its contenders' calls
    (``{contender: call}``), compiled first; in each of ``passes`` passes over the cases, after the GPU's clocks
    are warmed, each case's contenders are timed in turns (``timed_in_turns``)."""
    from numattn.bench import warm_clocks

    for calls in cases.values():  # compiled outside the timed turns
        for call in calls.values():
            call()
    times = {(case, name): [] for case, calls in cases.items() for name in calls}
    for _ in range(passes):
        warm_clocks(torch, 2.0)
        for case, calls in cases.items():
            for name, ms in timed_in_turns(torch, calls, rounds, warm=False).items():
                times[case, name].append(ms)
    return times


def compared(case, numattn_ms, flex_ms):
    """A row of ``case``: each side's median time over the passes, and the median of the passes' ratios of
    FlexAttention's time over numattn's (their range too)."""
    ratios = [f / n for f, n in zip(flex_ms, numattn_ms, strict=True)] if flex_ms else []
    return {"case": case, "numattn_ms": statistics.median(numattn_ms),
            "flex_ms": statistics.median(flex_ms) if flex_ms else None,
            "flex_over_numattn": statistics.median(ratios) if ratios else None,
            "flex_over_numattn_per_pass": ratios}


def training_rows(torch, q, k, v, slopes, cases, flex, passes):
    """``compared`` rows of forward + backward steps of each case (``cases``: name -> options, ``flex``: name ->
    FlexAttention forward call), q, k, v made leaves."""
    import numattn.torch as numattn_torch

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    do = torch.randn_like(q)

    def step(forward):
        def run():
            for x in leaves:
                x.grad = None
            forward().backward(do)
        return run

    calls = {case: {"numattn": step(lambda options=options: numattn_torch.attention(*leaves, **options))}
             for case, options in cases.items()}
    for case, forward in flex.items():
        calls[case]["flex"] = step(lambda forward=forward: forward(*leaves))
    times = timed_case_by_case(torch, calls, passes, rounds=5)
    return [compared(f"B4 H16 L8192 D128 bf16, forward + backward, {case}", times[case, "numattn"],
                     times.get((case, "flex"))) for case in cases]


def flex_calls(torch, q, k, v, slopes):
    """FlexAttention's calls of the comparison's cases, compiled once each (``{case: call(q, k, v)}``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    seqlen = q.shape[2]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 1024)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    masks = {mask: create_block_mask(mask, None, None, seqlen, seqlen) for mask in (causal, window)}
    return {
        "causal": lambda q, k, v: flex(q, k, v, block_mask=masks[causal]),
        "causal, window 1024": lambda q, k, v: flex(q, k, v, block_mask=masks[window]),
        "causal, softcap 30": lambda q, k, v: flex(q, k, v, score_mod=softcap, block_mask=masks[causal]),
        "causal, ALiBi": lambda q, k, v: flex(q, k, v, score_mod=alibi, block_mask=masks[causal]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and the run's facts to this file")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--training", action="store_true", help="also time forward + backward steps")
    parser.add_argument("--passes", type=int, default=3, help="passes over the cases (each ratio: their median)")
    args = parser.parse_args(argv)

    import torch

    import numattn
    from numattn.bench import backend_context, cuda_time_ms, run_facts, sdpa_backends_taking

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    rows = []
    q, k, v = (rnd(1, 16, 32768, 128) for _ in range(3))
    scaling_calls = {
        "causal": lambda: numattn.attention(q, k, v, causal=True),
        "causal, window 4096": lambda: numattn.attention(q, k, v, causal=True, window=(4096, 0)),
    }
    times = timed_case_by_case(torch, {"scaling": scaling_calls}, args.passes)
    scaling = {name: statistics.median(times["scaling", name]) for name in scaling_calls}
    fraction = rows_of_pairs(32768, 4096)
    ratios = [w / c for w, c in zip(times["scaling", "causal, window 4096"], times["scaling", "causal"], strict=True)]
    ratio = statistics.median(ratios)
    rows.append({"case": "B1 H16 L32768 D128 bf16, window 4096 against causal", "causal_ms": scaling["causal"],
                 "window_ms": scaling["causal, window 4096"], "visible_fraction": fraction, "time_ratio": ratio,
                 "ratio_over_fraction": ratio / fraction,
                 "ratio_over_fraction_per_pass": [r / fraction for r in ratios]})
    print(f"window 4096 at L32768: {scaling['causal, window 4096']:.3f} ms, causal {scaling['causal']:.3f} ms: "
          f"{ratio:.3f} of the time for {fraction:.3f} of the pairs ({ratio / fraction:.2f}x)", flush=True)
    del q, k, v

    q, k, v = (rnd(4, 16, 8192, 128) for _ in range(3))
    slopes = torch.rand(16, device="cuda", dtype=torch.float32) * 0.1
    sinks = torch.randn(16, device="cuda", dtype=torch.float32)
    cases = {
        "causal": dict(causal=True),
        "causal, window 1024": dict(causal=True, window=(1024, 0)),
        "causal, softcap 30": dict(causal=True, softcap=30.0),
        "causal, ALiBi": dict(causal=True, alibi_slopes=slopes),
        "causal, sinks": dict(causal=True, sinks=sinks),
    }
    contenders = {case: {"numattn": lambda options=options: numattn.attention(q, k, v, **options)}
                  for case, options in cases.items()}
    flex = {} if args.no_flex else flex_calls(torch, q, k, v, slopes)
    for case, call in flex.items():
        contenders[case]["flex"] = lambda call=call: call(q, k, v)
    times = timed_case_by_case(torch, contenders, args.passes)
    sdpa = {}
    for name in sdpa_backends_taking(torch, q, k, v, is_causal=True):
        with backend_context(name):
            sdpa[name] = cuda_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    best = min(sdpa, key=sdpa.get)
    print(f"best SDPA causal: {best} {sdpa[best]:.3f} ms", flush=True)
    for case in cases:
        row = compared(f"B4 H16 L8192 D128 bf16, {case}", times[case, "numattn"], times.get((case, "flex")))
        row.update(sdpa_causal_ms=sdpa[best], sdpa_backend=best)
        rows.append(row)
        versus = f"flex {row['flex_ms']:.3f} ms ({row['flex_over_numattn']:.2f}x)" if row["flex_ms"] else "flex -"
        print(f"{case:22} numattn {row['numattn_ms']:.3f} ms   {versus}", flush=True)
    if args.training:
        for row in training_rows(torch, q, k, v, slopes, cases, flex, args.passes):
            rows.append(row)
            versus = f"flex {row['flex_ms']:.3f} ms ({row['flex_over_numattn']:.2f}x)" if row["flex_ms"] else "flex -"
            print(f"{row['case']:60} numattn {row['numattn_ms']:.3f} ms   {versus}", flush=True)
    if args.json:
        facts = dict(run_facts(torch), command=" ".join(["python", "benchmarks/variants.py", *sys.argv[1:]]))
        Path(args.json).write_text(json.dumps({"run": facts, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
