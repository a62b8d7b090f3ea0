"""numattn at a base revision against the working tree, in one process on one GPU.

    python benchmarks/ab.py BASE [--json PATH] [--only TEXT]

``BASE`` is a git revision of this repository, or a directory holding the base's ``numattn`` package. The
package is exported (``git archive``) or copied into a temporary directory and imported as
``numattn_base`` beside the working tree's ``numattn`` (the package imports itself relatively, so the
copy runs as it was). Each case runs once in each package
(outputs compared), then both are timed in turns, five rounds after the GPU's clocks are warmed (the base
first in every other round): per round the median of CUDA-event timings with the L2 cache flushed. A restructuring that should
change nothing shows ratios within noise (about ±2%).

Cases: prefill (B4 H32 L4096 D128 bf16 and B8 H16 L2048 D64 fp16, causal and not; B4 H16 L4096 D256 bf16
causal; B4 H16 L8192 D128 bf16 causal, alone and with a window of 1024 or a softcap of 30; four packed causal
sequences of 4096, H32 D128; a short grid whose keys split, 256 queries over 16384 keys, D128 bf16 and D64
fp16), decode (B64 Hq32 Hkv8 L4096 D128 fp16: contiguous, with ``seqlens``, paged by 16 rows), MLA decode
(rank 512, rope 64: B768 H64 L2048 in pages of one row, B768 H16 L1024 in pages of 64), forward + backward
(B4 H32 L4096 D128 and D96 bf16, causal; B8 H16 L2048 D64 bf16 causal; B4 H16 L8192 D128 causal with a
window of 1024, ALiBi or a softcap of 30; four packed causal sequences of 4096, H32 D128), each with its
default arguments. ``--only TEXT`` keeps the cases whose names contain TEXT.
Then the host time per call of tiny problems (``numattn.bench.host_overhead_us``: rounds of 50
back-to-back calls, the packages in turns), where a change of the calls' Python path shows.
"""

import argparse
import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_NAME = "numattn_base"


def import_base(base, into):
    """``numattn`` at git revision ``base`` (or the package in directory ``base``), put into directory
    ``into`` and imported as ``numattn_base``."""
    if Path(base, "numattn").is_dir():
        shutil.copytree(Path(base, "numattn"), Path(into) / BASE_NAME)
    else:
        archive = subprocess.run(["git", "archive", base, "numattn"], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
        (Path(into) / "numattn").rename(Path(into) / BASE_NAME)
    sys.path.insert(0, str(into))
    return importlib.import_module(BASE_NAME)


def random_tensor(torch, *shape, dtype=None, grad=False):
    """A CUDA tensor of standard normal values (float16 unless ``dtype``)."""
    return torch.randn(*shape, device="cuda", dtype=dtype or torch.float16, requires_grad=grad)


def per_package(packages, call):
    """``{package name: call(package)}`` as calls of no argument."""
    return {pkg.__name__: (lambda pkg=pkg: call(pkg)) for pkg in packages}


def cases(torch, packages):
    """``{case: {package name: call}}`` on fresh random inputs."""
    from numattn.bench import paged_copy

    def rnd(*shape, **options):
        return random_tensor(torch, *shape, **options)

    table = {}
    for batch, heads, seqlen, head_dim, dtype in ((4, 32, 4096, 128, torch.bfloat16), (8, 16, 2048, 64, torch.float16)):
        q, k, v = (rnd(batch, heads, seqlen, head_dim, dtype=dtype) for _ in range(3))
        for causal in (False, True):
            name = f"prefill B{batch} H{heads} L{seqlen} D{head_dim} {str(dtype)[6:]}{' causal' if causal else ''}"
            table[name] = per_package(packages, lambda pkg, q=q, k=k, v=v, causal=causal: pkg.attention(q, k, v, causal=causal))
    q, k, v = (rnd(4, 16, 4096, 256, dtype=torch.bfloat16) for _ in range(3))
    table["prefill B4 H16 L4096 D256 bf16 causal"] = per_package(
        packages, lambda pkg, q=q, k=k, v=v: pkg.attention(q, k, v, causal=True))
    q, k, v = (rnd(4, 16, 8192, 128, dtype=torch.bfloat16) for _ in range(3))
    for label, options in (("", {}), (", window 1024", dict(window=(1024, 0))), (", softcap 30", dict(softcap=30.0))):
        table[f"prefill B4 H16 L8192 D128 bf16 causal{label}"] = per_package(
            packages, lambda pkg, q=q, k=k, v=v, options=options: pkg.attention(q, k, v, causal=True, **options))
    q, k, v = (rnd(4 * 4096, 32, 128, dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.arange(0, 4 * 4096 + 1, 4096, device="cuda", dtype=torch.int32)
    table["prefill, packed 4 × 4096 H32 D128 bf16 causal"] = per_package(
        packages, lambda pkg, q=q, k=k, v=v: pkg.attention_varlen(q, k, v, offsets, offsets, 4096, 4096, causal=True))
    for head_dim, dtype in ((128, torch.bfloat16), (64, torch.float16)):  # a short grid: its keys split, then merged
        q, k, v = rnd(1, 8, 256, head_dim, dtype=dtype), *(rnd(1, 8, 16384, head_dim, dtype=dtype) for _ in range(2))
        table[f"prefill, key splits B1 H8 Lq256 Lk16384 D{head_dim} {str(dtype)[6:]}"] = per_package(
            packages, lambda pkg, q=q, k=k, v=v: pkg.attention(q, k, v))

    query = rnd(64, 32, 128)
    k_cache, v_cache = rnd(64, 8, 4096, 128), rnd(64, 8, 4096, 128)
    lengths = torch.full((64,), 4096, dtype=torch.int32, device="cuda")
    k_pages, v_pages, page_table = paged_copy(torch, k_cache, v_cache, 16)
    table["decode B64 Hq32 Hkv8 L4096 D128 fp16"] = per_package(packages, lambda pkg: pkg.decode(query, k_cache, v_cache))
    table["decode, seqlens"] = per_package(packages, lambda pkg: pkg.decode(query, k_cache, v_cache, seqlens=lengths))
    table["paged_decode, pages of 16"] = per_package(
        packages, lambda pkg: pkg.paged_decode(query, k_pages, v_pages, page_table, lengths))

    rank, rope = 512, 64
    for batch, heads, seqlen, page_size in ((768, 64, 2048, 1), (768, 16, 1024, 64)):  # ordinary, persistent grid
        pages = batch * seqlen // page_size
        mla = (rnd(batch, heads, rank), rnd(batch, heads, rope), rnd(pages, page_size, rank),
               rnd(pages, page_size, rope), torch.randperm(pages, device="cuda").reshape(batch, -1).int(),
               torch.full((batch,), seqlen, device="cuda", dtype=torch.int32))
        table[f"mla_decode B{batch} H{heads} L{seqlen}, pages of {page_size}"] = per_package(
            packages, lambda pkg, mla=mla: pkg.mla_decode(*mla, scale=0.1))

    def training_step(pkg, leaves, do, varlen=(), **options):
        """Gradients of q, k, v through ``numattn.torch.attention`` (``attention_varlen`` with ``varlen``'s
        lengths); dQ returned."""
        for x in leaves:
            x.grad = None
        ops = importlib.import_module(f"{pkg.__name__}.torch")
        (ops.attention_varlen(*leaves, *varlen, **options) if varlen else ops.attention(*leaves, **options)).backward(do)
        return leaves[0].grad

    def training_case(name, shape, varlen=(), **options):
        leaves = [rnd(*shape, dtype=torch.bfloat16, grad=True) for _ in range(3)]
        do = rnd(*shape, dtype=torch.bfloat16)
        table[f"forward + backward {name}"] = per_package(
            packages, lambda pkg: training_step(pkg, leaves, do, varlen, causal=True, **options))

    for head_dim in (128, 96):  # the backward's wgmma kernel on sm_90, and its mma.sync kernel
        training_case(f"B4 H32 L4096 D{head_dim} bf16 causal", (4, 32, 4096, head_dim))
    training_case("B8 H16 L2048 D64 bf16 causal", (8, 16, 2048, 64))  # the wgmma backward with no producer
    slopes = torch.rand(16, device="cuda") / 4
    for label, options in (("window 1024", dict(window=(1024, 0))), ("ALiBi", dict(alibi_slopes=slopes)),
                           ("softcap 30", dict(softcap=30.0))):  # the score options' kernels
        training_case(f"B4 H16 L8192 D128 bf16 causal, {label}", (4, 16, 8192, 128), **options)
    lengths = torch.arange(0, 4 * 4096 + 1, 4096, device="cuda", dtype=torch.int32)  # packed sequences
    training_case("packed 4 × 4096 H32 D128 bf16 causal", (4 * 4096, 32, 128), (lengths, lengths, 4096, 4096))
    return table


def host_cases(torch, packages):
    """``{case: {package name: call}}`` of tiny problems, whose time is the host's."""

    def rnd(*shape):
        return random_tensor(torch, *shape)

    q, k, v = (rnd(1, 1, 16, 64) for _ in range(3))
    query, k_cache, v_cache = rnd(1, 8, 128), rnd(1, 2, 256, 128), rnd(1, 2, 256, 128)
    plans = {pkg.__name__: pkg.decode_plan(query, k_cache, v_cache) for pkg in packages}
    lengths = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    mla = [rnd(1, 16, 512), rnd(1, 16, 64), rnd(8192, 1, 512), rnd(8192, 1, 64),
           torch.arange(8192, device="cuda", dtype=torch.int32)[None], torch.full((1,), 8192, device="cuda",
                                                                                  dtype=torch.int32)]
    return {
        "host: attention B1 H1 L16 D64": per_package(packages, lambda pkg: pkg.attention(q, k, v)),
        "host: attention, return_lse": per_package(packages, lambda pkg: pkg.attention(q, k, v, return_lse=True)),
        "host: decode B1 Hq8 Hkv2 L256 D128": per_package(packages, lambda pkg: pkg.decode(query, k_cache, v_cache, check=False)),
        "host: decode, seqlens (checked)": per_package(packages, lambda pkg: pkg.decode(query, k_cache, v_cache, seqlens=lengths)),
        "host: decode_plan": {name: (lambda plan=plan: plan(query)) for name, plan in plans.items()},
        "host: mla_decode B1 H16 L8192 (split)": per_package(packages, lambda pkg: pkg.mla_decode(*mla, scale=0.1, check=False)),
    }


def selected(table, only):
    """The cases of ``table`` whose names contain ``only``."""
    return {case: calls for case, calls in table.items() if only in case}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision (or directory holding the numattn package) to compare with")
    parser.add_argument("--json", help="write the rows and the run's facts to this file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="run only the cases whose names contain this text")
    args = parser.parse_args(argv)

    import torch

    import numattn
    from numattn.bench import cuda_time_ms, host_overhead_us, run_facts, warm_clocks

    with tempfile.TemporaryDirectory() as into:
        base = import_base(args.base, into)
        rows, table = [], selected(cases(torch, (base, numattn)), args.only)
        for name, calls in table.items():
            first, outputs = {}, {}
            for pkg, call in calls.items():
                start = time.perf_counter()
                outputs[pkg] = call()
                torch.cuda.synchronize()
                first[pkg] = time.perf_counter() - start
            base_out, new_out = (out[0] if isinstance(out, tuple) else out for out in outputs.values())
            rows.append({"case": name, "max_abs_difference": (base_out.float() - new_out.float()).abs().max().item(),
                         "first_call_s": first})
        warm_clocks(torch, 2.0)
        for row, calls in zip(rows, table.values(), strict=True):
            times = {pkg: [] for pkg in calls}
            repeat = 5 if "backward" in row["case"] else 20
            for round_ in range(args.rounds):  # every other round the new package first
                for pkg, call in list(calls.items())[::-1 if round_ % 2 else 1]:
                    times[pkg].append(cuda_time_ms(call, repeat=repeat) * 1e3)
            row["base_us"], row["new_us"] = (statistics.median(ts) for ts in times.values())
            row["ratio"] = row["new_us"] / row["base_us"]
            print(f"{row['case']:50} {row['base_us']:9.1f} {row['new_us']:9.1f} {row['ratio']:7.3f}"
                  f"   max |base - new| {row['max_abs_difference']:.3g}", flush=True)
        host = selected(host_cases(torch, (base, numattn)), args.only)
        timed = host_overhead_us({(case, pkg): call for case, calls in host.items() for pkg, call in calls.items()})
        for case in host:
            row = {"case": case, "base_us": timed[case, BASE_NAME], "new_us": timed[case, "numattn"]}
            row["ratio"] = row["new_us"] / row["base_us"]
            rows.append(row)
            print(f"{case:50} {row['base_us']:9.1f} {row['new_us']:9.1f} {row['ratio']:7.3f}", flush=True)
    if args.json:
        facts = dict(run_facts(torch), base=args.base, command=" ".join(["python", "benchmarks/ab.py", *sys.argv[1:]]))
        Path(args.json).write_text(json.dumps({"run": facts, "ab": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
