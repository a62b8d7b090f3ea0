"""Compile numattn kernels to PTX without a GPU and print facts about the code, as JSON.

Run as a script with NUMBA_ENABLE_CUDASIM=0 (the tests do this in a subprocess,
since their own process may be running the simulator).
"""

import json
import re
import sys
import types as pytypes

import numba.cuda.dispatcher

# numba compiles device functions for the current device's compute capability;
# with no GPU present, name one.
numba.cuda.dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))

from numba import cuda, types  # noqa: E402

from numattn.configs.attention import (
    SimtConfig,  # noqa: E402
    choose_mma_config,  # noqa: E402
    choose_wgmma_config,  # noqa: E402
)
from numattn.kernels.attention_mma import mma_attention_kernel  # noqa: E402
from numattn.kernels.attention_simt import simt_attention_kernel  # noqa: E402
from numattn.kernels.attention_wgmma import wgmma_attention_kernel  # noqa: E402
from numattn.kernels.decode import decode_kernel, decode_mma_kernel  # noqa: E402

SIGNATURE = {
    storage: (types.Array(storage, 4, "A"),) * 4 + (types.Array(types.float32, 3, "A"), types.float32)
    for storage in (types.uint16, types.float32)
}
_U16, _F32, _I32 = (types.Array(t, n, "A") for t, n in ((types.uint16, 4), (types.float32, 3), (types.int32, 2)))
# split launches: partial outputs [.., S, Dv] and log2-sum-exps, the last-block tickets, the scale
SPLIT_SIGNATURE = (_U16,) * 4 + (_F32, types.Array(types.float32, 5, "A"), types.Array(types.float32, 4, "A"), _I32,
                   types.float32)
DECODE_SIGNATURE = (_U16,) * 3 + (_I32, types.Array(types.int32, 1, "A"), _U16, *SPLIT_SIGNATURE[4:])


def report(ptx):
    return {
        "local_bytes": sum(int(n) for n in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx)),
        "local_ops": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
        "atomics": sorted(set(re.findall(r"\batom\.[\w.]+", ptx))),
        "f64_ops": len(re.findall(r"\.f64\b", ptx)),
        "mnemonics": sorted(
            set(re.findall(r"(?:^|[{;])\s*((?:cvt|ex2|lg2|mma|ldmatrix|cp\.async|wgmma|mbarrier|fence|barrier\.cluster|mapa|ld\.shared::cluster)\.[\w.:]+)", ptx, re.M))
        ),
    }


def main():
    results = {}
    for dtype in ("float16", "bfloat16", "float32"):
        storage = types.float32 if dtype == "float32" else types.uint16
        for causal in (False, True):
            for head_dim in (64, 128):
                kernel = simt_attention_kernel(SimtConfig(64, 32, 128, 8), dtype, head_dim, head_dim, causal, True)
                ptx, _ = cuda.compile_ptx(kernel.py_func, SIGNATURE[storage], cc=(9, 0))
                results[f"simt-{dtype}-causal{int(causal)}-d{head_dim}"] = report(ptx)
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128, 256):  # the tile configurations chosen on an sm_90 GPU
            config = choose_mma_config(head_dim, head_dim, 227 * 1024)
            kernel = mma_attention_kernel(config, dtype, head_dim, head_dim, True, True)
            ptx, _ = cuda.compile_ptx(kernel.py_func, SIGNATURE[types.uint16], cc=(9, 0))
            results[f"mma-{dtype}-causal1-d{head_dim}"] = report(ptx)
            config = choose_wgmma_config(head_dim, head_dim, 227 * 1024)
            kernel = wgmma_attention_kernel(config, dtype, head_dim, head_dim, True, True, True)
            ptx, _ = cuda.compile_ptx(kernel.py_func, SIGNATURE[types.uint16], cc=(9, 0))
            results[f"wgmma-{dtype}-causal1-d{head_dim}"] = report(ptx)
    # split launches whose last block merges and resets its ticket counter for the next launch
    split_kernels = {
        "split-decode-mma": (decode_mma_kernel("float16", 128, 128, 4, 1, False, False, True, False, 3), DECODE_SIGNATURE),
        "split-decode-simt": (decode_kernel("float16", 128, 128, 4, 1, 16, False, True, True, False, True),
                              DECODE_SIGNATURE),
        "split-mma-attention": (mma_attention_kernel(choose_mma_config(64, 64, 227 * 1024), "float16", 64, 64, False,
                                                     False, True), SPLIT_SIGNATURE),
    }
    # key splits merged through distributed shared memory by a cluster of a query tile's blocks
    clustered = mma_attention_kernel(choose_mma_config(64, 64, 227 * 1024), "float16", 64, 64, True, True,
                                     split=True, cluster_merge=True)
    ptx, _ = cuda.compile_ptx(clustered.py_func, SPLIT_SIGNATURE, cc=(9, 0))
    results["cluster-mma-attention"] = report(ptx)
    for name, (kernel, signature) in split_kernels.items():
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        results[name] = report(ptx)
    # a paged cache: page indices copied into shared memory tiles ahead of their keys
    paged = decode_mma_kernel("float16", 128, 128, 4, 1, True, True, False, False, 2)
    ptx, _ = cuda.compile_ptx(paged.py_func, DECODE_SIGNATURE, cc=(9, 0))
    results["paged-decode-mma"] = report(ptx)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
