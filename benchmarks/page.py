"""The tables of docs/benchmarks.md, generated from the stored results in benchmarks/results/.

    python benchmarks/page.py           rewrite every generated block of the page
    python benchmarks/page.py --check   exit 1 (and name the blocks) if the page is out of date

The page is hand-written prose with generated blocks between ``<!-- generated: NAME -->`` and
``<!-- end generated -->``; each block is one table built from one results file (``SOURCES`` names it),
the facts of that file's run under it (GPU, date, revision, versions, command) and, where the project
set a target, a line saying whether the numbers meet it. To show a newer run, store its JSON in
benchmarks/results/ (``python -m numattn bench ... --json benchmarks/results/NAME.json``), point the
section's entry of ``SOURCES`` at it and run this script. Workloads are named by their shapes.

Needs only the standard library (no GPU, no numattn import).
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
# links from the page to files outside the documentation site (the results, the dated record) go to the repository
REPOSITORY = "https://github.com/numattn/numattn/blob/main"
BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)

# the results file (in benchmarks/results/, without .json) that feeds each generated block: for each
# section the most recent run that covers it
SOURCES = {
    "attention": "bench-h200-2026-11-28b",
    "decode-h200": "bench-h200-2026-11-24d",
    "decode-h100": "bench-h100-2026-11-24f",
    "mla": "bench-h100-2026-11-24c",
    "training": "bench-h200-2026-11-28c",
    "graph": "graph-h200-2026-11-27c",
    "checked": "bench-h200-2026-11-26",
    "cold-start": "coldstart-h200-2026-12-07",
    "host": "bench-h200-2026-11-24d",
    "cpu": "cpu-2026-11-26",
    "variants": "variants-h200-2026-12-07",
    "varlen": "varlen-h200-2026-12-07b",
}

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# the decode workloads of numattn.bench.DECODE_SHAPES, as the stored results label them in call names
DECODE_LABELS = {"W1": (64, 32, 8, 4096, 128, "float16"), "W2": (8, 32, 8, 32768, 128, "bfloat16"),
                 "W3": (1, 32, 8, 8192, 128, "float16")}
# the first-call cases of numattn.bench.COLD_START_CASES, by their stored names
COLD_START = {
    "attention bf16 D128 causal": "`attention` q, k, v (2, 16, 1024, 128) bf16, causal",
    "attention fp16 D64": "`attention` q, k, v (2, 16, 1024, 64) fp16",
    "decode fp16 D128": "`decode` q (8, 32, 128), cache (8, 8, 4096, 128) fp16",
    "mla_decode (512, 64)": "`mla_decode` B64 H16 L1000, rank 512, rope 64, pages of 64, fp16",
    "numattn.torch.attention fwd + bwd bf16 D128 GQA": "`numattn.torch.attention` forward + backward, q (2, 32, 1024, "
                                                       "128), k, v (2, 8, 1024, 128) bf16, causal",
    "torch SDPA bf16 D128 causal": "torch SDPA, as the first row",
}
# the host-overhead entries of bench_host_overhead and bench_decode_host_overhead, as the page names them
HOST_ATTENTION = {"numattn.attention": "`attention(q, k, v)`", "numattn.attention, return_lse": "`return_lse=True`",
                  "numattn.attention, causal, bshd": "`causal=True, layout=\"bshd\"`", "torch sdpa": "torch SDPA",
                  "torch.add": "`torch.add(a, a)`"}
HOST_DECODE = [  # (call, entry on the small cache, entry on B1 Hq32 Hkv8 L8192)
    ("`decode`", "numattn.decode", "numattn.decode, W3 (split)"),
    ("`decode` with `seqlens`", "numattn.decode, seqlens", None),
    ("`decode` with `out=`", "numattn.decode, out=", None),
    ("`paged_decode`, pages of 16", "numattn.paged_decode", None),
    ("a `decode_plan` call", "decode_plan", "decode_plan, W3 (split)"),
    ("a `decode_plan` call with `out=`", "decode_plan, out=", None),
    ("a `paged_decode_plan` call, pages of 16", "paged_decode_plan", None),
    ("torch SDPA (GQA)", "torch sdpa (GQA)", None),
    ("`torch.add(a, a)`", "torch.add", None),
]
BACKENDS = {"flash": "flash", "cudnn": "cuDNN", "efficient": "efficient"}


def load(name):
    return json.loads((RESULTS / f"{name}.json").read_text())


def dtype(name):
    return DTYPES.get(name, name)


def attention_workload(row):
    b, h, length, d = row["shape"]
    return f"B{b} H{h} L{length} D{d} {dtype(row['dtype'])}" + (" causal" if row.get("causal") else "")


def decode_workload(shape, dtype_name):
    b, hq, hkv, length, d = shape[:5]
    return f"B{b} Hq{hq} Hkv{hkv} L{length} D{d} {dtype(dtype_name)}"


def named_decode(text):
    """A stored call name with its decode label replaced by the workload's shape."""
    for label, shape in DECODE_LABELS.items():
        text = re.sub(rf"\b{label}\b", decode_workload(shape, shape[5]), text)
    return text


def num(value, digits=1):
    return "n/a" if value is None else f"{value:,.{digits}f}"


def pct(value, digits=0):
    return f"{value * 100:.{digits}f}%"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def run_line(data, name):
    """The facts of a stored run, one line under its table."""
    run = data.get("run", {})
    gpu = run.get("gpu") or run.get("cpu") or data.get("device", {}).get("name") or "device not recorded"
    versions = [f"{'CUDA' if key == 'cuda' else key} {run[key]}" for key in ("numattn", "torch", "cuda", "numba", "numba-cuda") if run.get(key)]
    missing = [key for key in ("numba", "numba-cuda", "cuda") if run.get(key) is None and key in run]
    if missing and run.get("gpu"):
        versions.append("not recorded: " + ", ".join(missing))
    command = run.get("command")
    if command and command.startswith("python -m numattn bench"):
        command = re.sub(r"--json \S+", f"--json benchmarks/results/{name}.json", command)
        if "--json" not in command:
            command += f" --json benchmarks/results/{name}.json"
    source = run.get("source", "")
    provenance = ("; run facts reconstructed from the history" if source.startswith("reconstructed")
                  else "; transcribed from the dated record" if source.startswith("transcribed") else "")
    return (f"*{gpu}, {run.get('date', 'date not recorded')[:10]}, revision {run.get('revision') or 'not recorded'}; "
            f"{', '.join(versions)}; " + (f"`{command}`" if command else "command not recorded")
            + f"; data: [{name}.json]({REPOSITORY}/benchmarks/results/{name}.json){provenance}.*")


def target(text, met):
    return f"- Target: {text} — **{'met' if met else 'not met'}**."


def best_sdpa(row, suffix):
    values = {name: row.get(f"{name}_{suffix}") for name in ("flash", "cudnn", "efficient")}
    values = {name: value for name, value in values.items() if value is not None}
    name = min(values, key=values.get)
    return BACKENDS[name], values[name]


# ---------------------------------------------------------------------------------------------------
# the blocks


def block_attention(data):
    peak = data["matmul_tflops"]
    rows = []
    for r in data["attention"]:
        backend, best = best_sdpa(r, "ms") if any(r.get(f"{b}_ms") for b in BACKENDS) else (None, None)
        rows.append([attention_workload(r), num(r["numattn_ms"], 3), num(r["numattn_tflops"]),
                     pct(r["numattn_tflops"] / peak, 1), num(r.get("flash_ms"), 3), num(r.get("cudnn_ms"), 3),
                     f"{pct(best / r['numattn_ms'])} ({backend})" if best else "n/a"])
    lines = table(["workload", "numattn ms", "TFLOP/s", f"of peak ({peak:.0f})", "SDPA flash ms", "SDPA cuDNN ms",
                   "best SDPA time / numattn's"], rows)
    goals = [r for r in data["attention"] if (tuple(r["shape"]), r["dtype"]) in
             {((4, 32, 4096, 128), "bfloat16"), ((8, 16, 2048, 64), "float16")}]
    ratios = [(attention_workload(r), r["flash_ms"] / r["numattn_ms"]) for r in goals]
    lines += ["", target("at least SDPA flash's speed in the same run on " + ", ".join(f"{w} ({pct(x)})" for w, x in ratios),
                     all(x >= 1 for _, x in ratios))]
    return lines


def block_decode(data):
    rows = []
    for r in data["decode"]:
        name, best = best_sdpa(r, "us")
        rows.append([decode_workload(r["shape"], r["dtype"]), num(r["numattn_us"]), f"{r['numattn_gbs']:,.0f}",
                     " / ".join(num(r.get(f"paged{p}_us")) for p in (1, 16, 64)), num(r.get("flash_us")),
                     num(r.get("cudnn_us")), f"{pct(best / r['numattn_us'])} ({name})"])
    lines = table(["workload", "numattn µs", "GB/s", "paged, pages of 1 / 16 / 64, µs", "SDPA flash µs",
                   "SDPA cuDNN µs", "numattn / best SDPA"], rows)
    by_shape = {tuple(r["shape"]) + (r["dtype"],): r for r in data["decode"]}
    big = by_shape[tuple(DECODE_LABELS["W1"][:5]) + (DECODE_LABELS["W1"][5],)]
    lines.append("")
    behind = big["numattn_us"] / big["cudnn_us"] - 1
    text = (f"{decode_workload(big['shape'], big['dtype'])} within 5% of cuDNN "
            f"({pct(abs(behind), 1)} {'behind' if behind > 0 else 'ahead'})")
    met = behind <= 0.05
    if data["device"]["name"] == "NVIDIA H200":
        text += f" at ≥ 4.0 TB/s ({big['numattn_gbs']:,.0f} GB/s)"
        met = met and big["numattn_gbs"] >= 4000
    lines.append(target(text, met))
    others = [by_shape[tuple(s[:5]) + (s[5],)] for label, s in DECODE_LABELS.items() if label != "W1"]
    parts = []
    for r in others:
        name, best = best_sdpa(r, "us")
        parts.append((f"{decode_workload(r['shape'], r['dtype'])} {num(r['numattn_us'])} µs against {name}'s "
                      f"{num(best)}", r["numattn_us"] <= best))
    lines.append(target("no slower than the best SDPA backend: " + "; ".join(p for p, _ in parts),
                        all(ok for _, ok in parts)))
    paged = [big[f"paged{p}_us"] / big["numattn_us"] - 1 for p in (1, 16, 64)]
    lines.append(target(f"paged within 10% of contiguous on {decode_workload(big['shape'], big['dtype'])} "
                        f"({' / '.join(pct(x, 1) for x in paged)} behind at pages of 1 / 16 / 64)",
                        max(paged) <= 0.10))
    return lines


def mla_config(text):
    """'wgmma 32/4, shared, persistent' from a stored MlaConfig description."""
    fields = dict(re.findall(r"(\w+)=('?[\w]+'?)", text))
    kernel = "wgmma" if fields.get("wgmma") == "True" else "mma.sync"
    name = f"{kernel} {fields['block_n']}/{fields['stages']}, {fields['warps']} warps, {fields['qk'].strip(chr(39))}"
    return name + (", persistent" if fields.get("persistent") == "True" else "")


def persistent_grid(config, heads):
    """Whether a stored MLA configuration ran the persistent grid: only without key splits and for at most 32
    heads (numattn.kernels.mla_wgmma.PERSISTENT_HEADS); otherwise a persistent configuration runs the ordinary
    kernel."""
    splits = int(re.search(r"(\d+) splits?", config).group(1))
    return "persistent=True" in config and splits == 1 and heads <= 32


def block_mla(data):
    copy = data["copy_gbs"]
    shapes, rows = {}, []
    for r in data["mla"]:
        shapes.setdefault(tuple(r["shape"]), []).append(r)
    others = [mla_config(r["config"]) for r in next(iter(shapes.values()))[1:]]
    for (b, h, length), runs in shapes.items():
        default, rest = runs[0], runs[1:]
        grid = "persistent grid" if persistent_grid(default["config"], h) else "ordinary grid"
        splits = re.search(r"(\d+) splits?", default["config"]).group(0)
        rows.append([f"B{b} H{h} L{length}", num(default["us"]), f"{default['gbs']:,.0f}", pct(default["gbs"] / copy, 1),
                     f"{grid}, {splits}"]
                    + [num(r.get("us")) + (" (ordinary grid)" if "persistent=True" in r["config"]
                                           and not persistent_grid(r["config"], h) else "") for r in rest])
    lines = table(["workload", "default µs", "GB/s", f"of copy ({copy:,.0f})", "default's grid"]
                  + [f"{o} µs" for o in others], rows)
    share = {shape: runs[0]["gbs"] / copy for shape, runs in shapes.items()}
    wide = [x for (b, _, _), x in share.items() if b == 768]
    deep = [x for (b, _, _), x in share.items() if b != 768]
    lines += ["", target(f"B768 at ≥ 90% of the copy rate ({pct(min(wide), 1)}–{pct(max(wide), 1)}) and B64 L32768 at ≥ 80% "
                     f"({', '.join(pct(x, 1) for x in deep)})", min(wide) >= 0.9 and min(deep) >= 0.8)]
    return lines


def block_training(data):
    rows = []
    for r in data["training"]:
        backend, best = best_sdpa(r, "ms")
        rows.append([attention_workload(r), num(r["numattn_ms"], 3), num(r["numattn_tflops"]), num(r["flash_ms"], 3),
                     num(r["cudnn_ms"], 3), pct(r["flash_ms"] / r["numattn_ms"]), f"{pct(best / r['numattn_ms'])} ({backend})",
                     num(r["numattn_fwd_ms"], 3)])
    lines = table(["workload", "numattn ms", "TFLOP/s", "SDPA flash ms", "SDPA cuDNN ms", "flash's time / numattn's",
                   "best SDPA time / numattn's", "numattn forward alone, ms"], rows)
    goal = [r["flash_ms"] / r["numattn_ms"] for r in data["training"]
            if tuple(r["shape"]) == (4, 32, 4096, 128) and r["causal"]]
    lines += ["", target(f"B4 H32 L4096 D128 bf16 causal at least SDPA flash's speed ({pct(goal[0])})", goal[0] >= 1)]
    return lines


def block_graph(data):
    rows = []
    for r in data["graph"]:
        b = r["b"]
        rows.append([f"b = {b}: Q ({2 * b}, 256, 64), K ({2 * b}, 64, 4096), V ({2 * b}, 4096, 64)", num(r["numattn_us"]),
                     num(r.get("flash_us")), num(r.get("cudnn_us")), num(r.get("efficient_us")), num(r["eager_us"]),
                     f"`{r['winner']}`", f"{r['search_s']:.1f} s / {r['cached_search_s'] * 1e3:.0f} ms",
                     f"{r['max_error']:.1e}"])
    lines = table(["graph (fp16)", "numattn µs", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "torch eager", "winner",
                   "search, uncached / cached", "max error"], rows)
    parts = []
    for r in data["graph"]:
        best = r[f"{r['best_sdpa']}_us"]
        parts.append((f"b = {r['b']} {r['numattn_us'] / best:.2f}× {BACKENDS[r['best_sdpa']]}'s time",
                      r["numattn_us"] <= best))
    lines += ["", target("at most the best SDPA backend's time at every b: "
                         + ", ".join(f"{p} ({'met' if ok else 'not met'})" for p, ok in parts), all(ok for _, ok in parts))]
    return lines


def block_checked(data):
    rows, diffs = [], []
    for r in data["checked"]:
        call = named_decode(r["call"])
        call = re.sub(r"^mla B(\d+) H(\d+) L(\d+) pages of (\d+)$", r"`mla_decode` B\1 H\2 L\3, pages of \4", call)
        call = re.sub(r"^(decode\(seqlens=\)|paged_decode) ", r"`\1` ", call)
        per_call, loop = r["default_us"] / r["unchecked_us"] - 1, r["default_loop_us"] / r["unchecked_loop_us"] - 1
        diffs += [per_call, loop]
        rows.append([call, num(r["default_us"]), num(r["unchecked_us"]), f"{per_call:+.1%}", num(r["default_loop_us"]),
                     num(r["unchecked_loop_us"]), f"{loop:+.1%}"])
    lines = table(["call (fp16)", "default µs", "`check=False` µs", "difference", "default, in a loop",
                   "`check=False`, in a loop", "difference"], rows)
    lines += ["", target(f"the default within 3% of `check=False` ({min(diffs):+.1%} to {max(diffs):+.1%})",
                         max(diffs) <= 0.03)]
    return lines


def block_cold_start(data):
    rows = []
    for r in data["cold_start"]:
        compiles = " + ".join(f"{statistics.median(times):.2f}" for times in r["compile_s"].values())
        rows.append([COLD_START.get(r["case"], r["case"]), num(r["cold"]["first_call_s"], 2),
                     num(r["warm"]["first_call_s"], 3), num(r["off"]["first_call_s"], 2), compiles or "–",
                     f"{r['warm']['second_call_s'] * 1e3:.2f} ms", num(r["warm"]["numattn_import_s"], 2)])
    lines = table(["first call, s", "kernel cache empty", "filled", "off", "its kernels' compiles, median s",
                   "second call", "import of numattn, s"], rows)
    ours = [r for r in data["cold_start"] if not r["case"].startswith("torch")]
    filled = [r["warm"]["first_call_s"] for r in ours]
    imports = [r[k]["numattn_import_s"] for r in ours for k in ("cold", "warm", "off")]
    kernels = {label: times for r in ours for label, times in r["compile_s"].items()}  # every numattn case's kernels
    processes = min(map(len, kernels.values()))
    medians = {label: statistics.median(times) for label, times in kernels.items()}
    slowest = max(medians, key=medians.get)
    slowest_row = next(COLD_START.get(r["case"], r["case"]) for r in ours if slowest in r["compile_s"])
    single = [t for times in kernels.values() for t in times]
    firsts = [r["cold"]["first_call_s"] for r in ours]
    steps = data["gqa_transformer_300_steps_s"]
    ratio = steps["cache filled"]["numattn"] / steps["cache filled"]["sdpa"]
    example = data.get("gqa_transformer_run", {})
    run = data["run"]
    elsewhere = (f" (on an {example['gpu']}, {example['date']}, revision {example['revision']})"
                 if example and (example["gpu"], example["revision"]) != (run["gpu"], run["revision"]) else "")
    lines += ["", f"`examples/gqa_transformer.py --steps 300`{elsewhere}: {steps['cache empty']['numattn']} s with the "
                  f"cache empty (SDPA {steps['cache empty']['sdpa']} s), {steps['cache filled']['numattn']} s with it "
                  f"filled (SDPA {steps['cache filled']['sdpa']} s).", "",
              target(f"the first call with the cache filled ≤ 1 s ({min(filled) * 1e3:.0f}–{max(filled) * 1e3:.0f} ms)",
                     max(filled) <= 1),
              target(f"`import numattn` ≤ 1 s on top of torch and numba ({min(imports):.2f}–{max(imports):.2f} s)",
                     max(imports) <= 1),
              target(f"a first-ever compile ≤ 5 s per attention or decode kernel: each kernel's median over the "
                     f"{processes}–{max(map(len, kernels.values()))} fresh processes that compiled it, at most "
                     f"{medians[slowest]:.2f} s (row {slowest_row}); single compiles up to "
                     f"{max(single):.2f} s, the calls' first times with the cache empty "
                     f"{min(firsts):.2f}–{max(firsts):.2f} s", medians[slowest] <= 5),
              target(f"the example's 300 steps with the cache filled within 1.5× SDPA's time ({ratio:.2f}×)", ratio <= 1.5)]
    return lines


def block_host(data):
    attention = data["host_overhead_us"]
    lines = table(list(HOST_ATTENTION.values()), [[num(attention.get(key), 2) for key in HOST_ATTENTION]])
    decode = data["decode_host_overhead_us"]
    rows = [[call, num(decode.get(small), 2), num(decode.get(split), 2) if split else ""] for call, small, split in HOST_DECODE]
    lines += [""] + table(["decode call, µs", "B1 Hq8 Hkv2 L256 D128 fp16", "B1 Hq32 Hkv8 L8192 D128 fp16 (key splits)"],
                          rows)
    plan = decode["decode_plan, W3 (split)"]
    lines += ["", target(f"a decode step on B1 Hq32 Hkv8 L8192 D128 fp16 in ≤ 10 µs of host time: a plan's call took "
                         f"{plan:.2f} µs while `torch.add` took {decode['torch.add']:.2f}", plan <= 10)]
    return lines


def block_cpu(data):
    rows = []
    for r in data["cpu"]:
        if r["call"] == "mirage_gqa_tutorial":
            rows.append(["Mirage's GQA tutorial end to end: `superoptimize` in a fresh cache and the call",
                         f"{r['seconds']:.1f} s"])
            continue
        what = (f"`{r['call']}` q {tuple(r['q'])}, k, v {tuple(r['kv'])} {dtype(r['dtype'])}"
                + (", causal" if r.get("causal") else "") + (", with `seqlens`" if r.get("seqlens") else ""))
        rows.append([what, f"{r['seconds'] * 1e3:.1f} ms"])
    tutorial = next(r["seconds"] for r in data["cpu"] if r["call"] == "mirage_gqa_tutorial")
    return table(["call (one warm call)", "time"], rows) + [
        "", target(f"Mirage's tutorial, both calls, ≤ 60 s on a two-core machine ({tutorial:.1f} s)", tutorial <= 60)]


def block_variants(data):
    scaling, *rest = data["rows"]
    cases = [r for r in rest if "sdpa_backend" in r]  # the forward passes
    steps = {r["case"].split("forward + backward, ", 1)[1]: r for r in rest if "sdpa_backend" not in r}  # --training

    def ratio(row):
        return f"{row['flex_over_numattn']:.2f}" if row and row["flex_ms"] else "n/a"

    rows = []
    for r in cases:
        name = r["case"].split(", ", 1)[1]
        step = steps.get(name)
        rows.append([name, num(r["numattn_ms"], 3), num(r["flex_ms"], 3), ratio(r)]
                    + ([num(step["numattn_ms"], 3), num(step["flex_ms"], 3), ratio(step)] if steps else []))
    header = ["B4 H16 L8192 D128 bf16", "numattn ms", "FlexAttention ms", "FlexAttention / numattn"]
    if steps:
        header += ["numattn fwd + bwd ms", "FlexAttention fwd + bwd ms", "FlexAttention / numattn, fwd + bwd"]
    lines = table(header, rows)
    compared = [r for r in [*cases, *steps.values()] if r["flex_ms"]]
    over = scaling["ratio_over_fraction"]

    def spread(row, key, decimals):
        """``row[key]``, and the range of the run's passes where it had several."""
        passes = row.get(f"{key}_per_pass", [])
        span = f" ({min(passes):.{decimals}f}–{max(passes):.{decimals}f})" if len(passes) > 1 else ""
        return f"{row[key]:.{decimals}f}{span}"

    lines += ["", f"- Best SDPA causal: {BACKENDS[cases[0]['sdpa_backend']]} {cases[0]['sdpa_causal_ms']:.3f} ms. "
              f"B1 H16 L32768 D128 bf16: causal {scaling['causal_ms']:.3f} ms, window 4096 {scaling['window_ms']:.3f} "
              f"ms, {pct(scaling['time_ratio'], 1)} of the time for {pct(scaling['visible_fraction'], 1)} of the pairs.",
              target(f"a window's time at most 1.15 × its visible fraction of the causal time: "
                     f"{spread(scaling, 'ratio_over_fraction', 3)}", over <= 1.15),
              target("numattn at least 1.3 × FlexAttention's speed on each variant ("
                     + "; ".join(f"{r['case'].split(', ', 1)[1]}: {spread(r, 'flex_over_numattn', 2)}" for r in compared)
                     + ")", all(r["flex_over_numattn"] >= 1.3 for r in compared))]
    return lines


def block_varlen(data):
    rows = [[r["case"].split(", ")[-1], num(r["ms"], 3), f"{r['over_padded']:.3f}"] for r in data["rows"]]
    equal = [r for r in data["rows"] if r["case"].startswith("B") and r["case"].endswith(", packed")][0]
    label = equal["case"].rsplit(", ", 1)[0]
    lines = table(["layout", "ms", "over the padded batch"], rows[: len(rows) - 2])
    uneven = data["rows"][-2:]
    lines += ["", f"- {label}; uneven: {uneven[0]['case'].rsplit(', ', 1)[0]}, padded to the longest "
              f"{uneven[0]['ms']:.3f} ms, packed {uneven[1]['ms']:.3f} ms.",
              target(f"equal lengths, packed, within 3% of the padded batch ({equal['over_padded']:.3f})",
                     equal["over_padded"] <= 1.03)]
    return lines


BLOCKS = {
    "attention": block_attention,
    "decode-h200": block_decode,
    "decode-h100": block_decode,
    "mla": block_mla,
    "training": block_training,
    "graph": block_graph,
    "checked": block_checked,
    "cold-start": block_cold_start,
    "host": block_host,
    "cpu": block_cpu,
    "variants": block_variants,
    "varlen": block_varlen,
}


def render(name):
    if name not in BLOCKS:
        raise SystemExit(f"docs/benchmarks.md has a generated block {name!r} that {Path(__file__).name} does not know")
    source = SOURCES[name]
    data = load(source)
    return BLOCKS[name](data) + ["", run_line(data, source)]


def generate(text):
    """The page with every generated block rebuilt; the names of the blocks found."""
    found = []

    def replace(match):
        found.append(match.group(2))
        return match.group(1) + "\n".join(render(match.group(2))) + "\n" + match.group(4)

    return BLOCK.sub(replace, text), found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    new, found = generate(text)
    missing = sorted(set(BLOCKS) - set(found))
    if missing:
        print(f"docs/benchmarks.md lacks the generated blocks {missing}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            stale = [name for name, old, fresh in zip(found, BLOCK.findall(text), BLOCK.findall(new), strict=True)
                     if old != fresh]
            print(f"docs/benchmarks.md is out of date (blocks: {', '.join(stale) or 'layout'}); "
                  "run python benchmarks/page.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        PAGE.write_text(new)
        print(f"rewrote {len(found)} generated blocks of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
