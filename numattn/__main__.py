"""Command line: ``python -m numattn demo | bench | info``."""

import argparse
import sys
import time

import numpy as np

import numattn
from numattn import reference


def demo(args):
    """Fused attention on the GPU (or in the simulator), checked against the float64 reference."""
    from numattn.kernels.launch import device_limits

    if numattn.SIMULATOR:
        where = "numba CUDA simulator (no GPU found)"
        shape_q, shape_kv = (1, 4, 48, 32), (1, 2, 40, 32)
    else:
        where = device_limits(0)["name"]
        shape_q, shape_kv = (2, 16, 1024, 64), (2, 4, 1024, 64)
    rng = np.random.default_rng(args.seed)
    print(f"numattn {numattn.__version__} on {where}")
    print(f"{'dtype':>9} {'causal':>6}  {'q':>20} {'k, v':>20} {'max |err|':>10} {'time':>10}")
    worst = 0.0
    for dtype, tol in (("float32", 1e-4), ("float16", 4e-3)):
        for causal in (False, True):
            q = rng.standard_normal(shape_q).astype(dtype)
            k = rng.standard_normal(shape_kv).astype(dtype)
            v = rng.standard_normal(shape_kv).astype(dtype)
            numattn.attention(q, k, v, causal=causal)  # compile
            start = time.perf_counter()
            o = numattn.attention(q, k, v, causal=causal)
            elapsed = time.perf_counter() - start
            err = float(np.abs(o.astype(np.float64) - reference.attention(q, k, v, causal=causal)).max())
            worst = max(worst, err / tol)
            print(
                f"{dtype:>9} {str(causal):>6}  {str(q.shape):>20} {str(k.shape):>20} "
                f"{err:10.2e} {elapsed * 1e3:8.1f} ms"
            )
    print("time: one call, host arrays in and out" + (" (copies included)" if not numattn.SIMULATOR else ""))
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run fused attention and check it against float64")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_info = sub.add_parser("info", help="where kernels run")
    p_info.set_defaults(func=info)
    p_bench = sub.add_parser("bench", help="GPU benchmark against torch SDPA backends (needs torch)")
    p_bench.add_argument("--quick", action="store_true", help="fewer shapes")
    p_bench.add_argument("--json", help="also write the results to this file")
    p_bench.add_argument("--decode", action="store_true", help="also the decode targets (decode, paged_decode)")
    p_bench.add_argument("--mla", action="store_true", help="also mla_decode in FlashInfer's metric, with the copy rate")
    p_bench.add_argument("--graph", action="store_true", help="also the superoptimized Mirage GQA graph (W6)")
    p_bench.add_argument("--training", action="store_true", help="also forward + backward (W8)")
    p_bench.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
