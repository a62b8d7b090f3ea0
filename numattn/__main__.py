"""Command line: ``python -m numattn demo | bench | info | cache | precompile``."""

import argparse
import contextlib
import sys
import time

import numpy as np

import numattn
from numattn import reference
from numattn.kernels.launch import GPUS
from numattn.precompile import ARCHES, PRESETS
from numattn.precompile import main as precompile_main


def demo(args):
    """Fused attention checked against the float64 reference: on the GPU when there is one; without one,
    on the CPU path at a realistic size and the GPU kernels in numba's CUDA simulator at a small one."""
    from numattn.kernels.launch import device_limits

    if numattn.SIMULATOR:
        runs = [("CPU path (numba's CPU JIT; no GPU found)", False, (2, 16, 1024, 64), (2, 4, 1024, 64)),
                ("GPU kernels in numba's CUDA simulator (numattn.simulate())", True, (1, 4, 48, 32), (1, 2, 40, 32))]
    else:
        runs = [(device_limits(0)["name"], None, (2, 16, 1024, 64), (2, 4, 1024, 64))]
    rng = np.random.default_rng(args.seed)
    print(f"numattn {numattn.__version__}")
    worst = 0.0
    for where, simulated, shape_q, shape_kv in runs:
        print(f"\n{where}")
        print(f"{'dtype':>9} {'causal':>6}  {'q':>20} {'k, v':>20} {'max |err|':>10} {'time':>10}")
        for dtype, tol in (("float32", 1e-4), ("float16", 4e-3)):
            for causal in (False, True):
                q = rng.standard_normal(shape_q).astype(dtype)
                k = rng.standard_normal(shape_kv).astype(dtype)
                v = rng.standard_normal(shape_kv).astype(dtype)
                with numattn.simulate(simulated) if simulated is not None else contextlib.nullcontext():
                    numattn.attention(q, k, v, causal=causal)  # compile
                    start = time.perf_counter()
                    o = numattn.attention(q, k, v, causal=causal)
                    elapsed = time.perf_counter() - start
                err = float(np.abs(o.astype(np.float64) - reference.attention(q, k, v, causal=causal)).max())
                worst = max(worst, err / tol)
                print(f"{dtype:>9} {str(causal):>6}  {str(q.shape):>20} {str(k.shape):>20} "
                      f"{err:10.2e} {elapsed * 1e3:8.1f} ms")
    print("\ntime: one call, host arrays in and out" + (" (copies included)" if not numattn.SIMULATOR else ""))
    if worst > 1:
        print("FAILED: error above tolerance")
        return 1
    print("OK: every result within tolerance of the float64 reference")
    return 0


def info(args):
    from numattn.kernels.launch import device_limits

    print(f"numattn {numattn.__version__}, simulator: {numattn.SIMULATOR}")
    if not numattn.SIMULATOR:
        print(device_limits(0))
    return 0


def bench(args):
    from numattn.bench import main as bench_main

    return bench_main(args)


def cache(args):
    """``cache info``: where compiled kernels are kept, each entry's kernel and size; ``cache clear``."""
    from numattn.kernels import kernel_cache

    directory = kernel_cache.cache_directory()
    if directory is None:
        print("the kernel cache is off (NUMATTN_KERNEL_CACHE=off): every process compiles its kernels")
        return 0
    if args.action == "clear":
        print(f"removed {kernel_cache.clear(directory)} compiled kernels from {directory}")
        return 0
    listed = kernel_cache.entries(directory)
    total = sum(size for _, _, size in listed)
    print(f"kernel cache: {directory}{'' if directory.is_dir() else ' (not created yet)'}")
    print(f"{len(listed)} compiled kernels, {total / 2**20:.1f} MiB")
    for path, label, size in listed:
        print(f"  {path.stem[:16]}  {size / 1024:8.1f} KiB  {label if label is not None else '(damaged: recompiled on use)'}")
    return 0


def _count(text):
    """A count of at least 1, for argparse."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numattn", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="run fused attention and check it against float64")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_info = sub.add_parser("info", help="where kernels run")
    p_info.set_defaults(func=info)
    p_bench = sub.add_parser("bench", help="GPU benchmark against torch SDPA backends (needs torch)")
    p_bench.add_argument("--quick", action="store_true", help="fewer shapes")
    p_bench.add_argument("--only", action="store_true", help="only the sections the other flags add, without the "
                         "attention table and host overhead")
    p_bench.add_argument("--json", help="also write the results to this file")
    p_bench.add_argument("--decode", action="store_true", help="also the decode targets (decode, paged_decode)")
    p_bench.add_argument("--mla", action="store_true", help="also mla_decode in FlashInfer's metric, with the copy rate")
    p_bench.add_argument("--graph", action="store_true", help="also the superoptimized Mirage GQA graph (fp16, 256 "
                         "queries against 4096 keys, Mirage's b = 1 and 8): search seconds, µs per call against SDPA "
                         "and torch eager")
    p_bench.add_argument("--training", action="store_true", help="also forward + backward of numattn.torch.attention "
                         "against SDPA (bf16, batch 4, 32 heads, 4096 tokens, head_dim 128 and 64, causal or not)")
    p_bench.add_argument("--checked", action="store_true", help="also the default check=True of decode, paged_decode "
                         "and mla_decode against check=False")
    p_bench.add_argument("--cold-start", action="store_true", help="also the first call of attention, decode, "
                         "mla_decode and the autograd function in fresh processes, with the kernel cache empty, "
                         "filled and off")
    p_bench.add_argument("--repeats", type=_count, default=3, metavar="N", help="with --cold-start: fresh processes "
                         "per case with the cache off, each compiling every kernel again (default 3)")
    p_bench.set_defaults(func=bench)
    p_cache = sub.add_parser("cache", help="the compiled kernels kept on disk: where, which, how large; or remove them")
    p_cache.add_argument("action", choices=("info", "clear"), help="info: list the entries; clear: remove them all")
    p_cache.set_defaults(func=cache)
    p_pre = sub.add_parser("precompile", help="compile the kernels of common models or given calls into the kernel "
                           "cache, in parallel processes")
    p_pre.add_argument("--preset", action="append", choices=sorted(PRESETS), help="a model's calls (repeatable)")
    p_pre.add_argument("--workload", action="append", metavar="JSON", help="one call, as numattn.Workload's fields, "
                       'e.g. \'{"op": "attention", "heads_q": 32, "heads_kv": 8, "head_dim": 128}\' (repeatable)')
    p_pre.add_argument("--processes", type=int, help="worker processes (default: one per call, at most 4)")
    p_pre.add_argument("--gpu", choices=[*GPUS, *ARCHES], help="compile for this GPU model (or a model of this "
                       "compute capability) instead of running the calls: no GPU needed, nothing runs")
    p_pre.set_defaults(func=precompile_main)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
