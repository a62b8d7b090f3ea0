"""Compile numattn kernels without a GPU and report on the code.

``python tests/ptx_report.py`` prints facts about each variant's PTX as JSON (the tests run it).
``python tests/ptx_report.py --resources`` compiles each variant (and the backward and MLA kernels) the
way numba does on an sm_90 GPU, LTO-IR from NVVM linked by nvJitLink for sm_90a, and prints the
registers and spills ptxas reports: a change that makes a kernel spill shows here, without a GPU, as
long as the toolkit's NVVM and nvJitLink are the versions of the GPU machine.

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
    SEQUENCES_REGISTERS,  # noqa: E402
    SimtConfig,  # noqa: E402
    WgmmaConfig,  # noqa: E402
    choose_mma_config,  # noqa: E402
    choose_wgmma_config,  # noqa: E402
    wgmma_configs,  # noqa: E402
)
from numattn.configs.backward import choose_backward_config, choose_backward_wgmma_config  # noqa: E402
from numattn.configs.decode import (  # noqa: E402
    MMA_ROWS,
    MMA_SPLITTING,
    SIMT_SPLITTING,
    DecodeConfig,
    decode_mma_shared_bytes,
)
from numattn.configs.mla import mla_default_config  # noqa: E402
from numattn.kernels.attention_backward_mma import backward_mma_kernel  # noqa: E402
from numattn.kernels.attention_backward_wgmma import backward_wgmma_kernel, dq_rows_kernel  # noqa: E402
from numattn.kernels.attention_mma import mma_attention_kernel  # noqa: E402
from numattn.kernels.attention_simt import simt_attention_kernel  # noqa: E402
from numattn.kernels.attention_wgmma import wgmma_attention_kernel  # noqa: E402
from numattn.kernels.decode import decode_kernel, decode_mma_kernel  # noqa: E402
from numattn.kernels.mla import mla_decode_kernel  # noqa: E402
from numattn.kernels.score_mods import ScoreMods  # noqa: E402
from numattn.kernels.sequences import SequenceLayout  # noqa: E402

# the attention kernels' score-modification arguments: alibi, sinks, left, right, cap_log2, cap_slope
MOD_SIGNATURE = (types.Array(types.float32, 2, "A"), types.Array(types.float32, 1, "A"), types.int64, types.int64,
                 types.float32, types.float32)
SIGNATURE = {
    storage: (types.Array(storage, 4, "A"),) * 4 + (types.Array(types.float32, 3, "A"), types.float32, *MOD_SIGNATURE)
    for storage in (types.uint16, types.float32)
}
EVERY_MOD = ScoreMods(window=True, softcap=True, alibi=True, sinks=True)
# a varlen kernel's cu_seqlens_q, cu_seqlens_k, seqused_k and page_table
SEQUENCE_SIGNATURE = (*(types.Array(types.int32, 1, "A"),) * 3, types.Array(types.int32, 2, "A"))
_U16, _F32, _I32, _U16_3 = (types.Array(t, n, "A") for t, n in ((types.uint16, 4), (types.float32, 3),
                                                                  (types.int32, 2), (types.uint16, 3)))
# split launches: partial outputs [.., S, Dv] and log2-sum-exps, the last-block tickets, the scale
SPLIT_SIGNATURE = (_U16,) * 4 + (_F32, types.Array(types.float32, 5, "A"), types.Array(types.float32, 4, "A"), _I32,
                   types.float32)
DECODE_SIGNATURE = (_U16,) * 3 + (_I32, types.Array(types.int32, 1, "A"), _U16, *SPLIT_SIGNATURE[4:], *MOD_SIGNATURE)
ATTENTION_SPLIT_SIGNATURE = SPLIT_SIGNATURE + MOD_SIGNATURE
# q, k, v, dO, lse2, delta, the float32 dQ accumulator (rows for the mma.sync kernel, whole tiles in fragment order
# for the wgmma kernel), dK, dV, scale, scale_log2
BACKWARD_SIGNATURE, BACKWARD_WGMMA_SIGNATURE = (
    (_U16,) * 4 + (_F32, _F32, types.Array(types.float32, dq_rank, "A"), _U16, _U16, types.float32, types.float32,
                   *MOD_SIGNATURE) for dq_rank in (4, 3))


def backward_wgmma_signature(config, offsets=()):
    """The wgmma backward's argument types: packed sequences' ``offsets`` (``cu_seqlens_q``, ``cu_seqlens_k``),
    then with tensor copies the tensor maps of Q and dO."""
    return BACKWARD_WGMMA_SIGNATURE + offsets + ((types.Array(types.uint64, 2, "A"),) if config.tensor_copies else ())


def report(ptx):
    return {
        "local_bytes": sum(int(n) for n in re.findall(r"\.local\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx)),
        "local_ops": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
        "atomics": sorted(set(re.findall(r"\batom\.[\w.]+", ptx))),
        "f64_ops": len(re.findall(r"\.f64\b", ptx)),
        "mnemonics": sorted(
            set(re.findall(r"(?:^|[{;])\s*((?:cvt|ex2|lg2|mma|ldmatrix|cp\.async|wgmma|mbarrier|fence|barrier\.cluster|mapa|ld\.shared::cluster|setmaxnreg)\.[\w.:]+)", ptx, re.M))
        ),
    }


def variants():
    """``(name, kernel, signature)`` of the kernel variants whose PTX facts the tests check."""
    for dtype in ("float16", "bfloat16", "float32"):
        storage = types.float32 if dtype == "float32" else types.uint16
        for causal in (False, True):
            for head_dim in (64, 128):
                kernel = simt_attention_kernel(SimtConfig(64, 32, 128, 8), dtype, head_dim, head_dim, causal, True)
                yield f"simt-{dtype}-causal{int(causal)}-d{head_dim}", kernel, SIGNATURE[storage]
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128, 256):  # the tile configurations chosen on an sm_90 GPU
            config = choose_mma_config(head_dim, head_dim, 227 * 1024)
            kernel = mma_attention_kernel(config, dtype, head_dim, head_dim, True, True)
            yield f"mma-{dtype}-causal1-d{head_dim}", kernel, SIGNATURE[types.uint16]
            config = choose_wgmma_config(head_dim, head_dim, 227 * 1024)
            kernel = wgmma_attention_kernel(config, dtype, head_dim, head_dim, True, True, True)
            yield f"wgmma-{dtype}-causal1-d{head_dim}", kernel, SIGNATURE[types.uint16]
    # a large grid that walks its heads in sections
    kernel = wgmma_attention_kernel(choose_wgmma_config(128, 128, 227 * 1024), "bfloat16", 128, 128, True, True, True,
                                    sequences=SequenceLayout(sections=True))
    yield "wgmma-bfloat16-causal1-d128-sections", kernel, SIGNATURE[types.uint16]
    # the producer's copies by TMA, from tensor maps in the kernel's last argument
    kernel = wgmma_attention_kernel(choose_wgmma_config(128, 128, 227 * 1024), "bfloat16", 128, 128, True, True, True,
                                    tensor_copies=True)
    yield "wgmma-bfloat16-causal1-d128-tensor-copies", kernel, SIGNATURE[types.uint16] + (types.Array(types.uint64, 2, "A"),)
    # a persistent block: query tile after query tile, K and V in split rings
    kernel = wgmma_attention_kernel(WgmmaConfig(128, 2, 2, producer=True, persistent=True), "bfloat16", 128, 128, True,
                                    True, True, tensor_copies=True)
    yield ("wgmma-bfloat16-causal1-d128-persistent-tensor-copies", kernel,
           SIGNATURE[types.uint16] + (types.Array(types.uint64, 2, "A"),))
    # every score modification at once: sliding window, softcap, ALiBi, sinks
    for head_dim in (64, 128):
        mma_config = choose_mma_config(head_dim, head_dim, 227 * 1024)
        wgmma_config = choose_wgmma_config(head_dim, head_dim, 227 * 1024, mods=EVERY_MOD)
        kernel = mma_attention_kernel(mma_config, "bfloat16", head_dim, head_dim, True, True, mods=EVERY_MOD)
        yield f"mma-bfloat16-causal1-d{head_dim}-mods", kernel, SIGNATURE[types.uint16]
        kernel = wgmma_attention_kernel(wgmma_config, "bfloat16", head_dim, head_dim, True, True, True, mods=EVERY_MOD)
        yield f"wgmma-bfloat16-causal1-d{head_dim}-mods", kernel, SIGNATURE[types.uint16]
    kernel = simt_attention_kernel(SimtConfig(64, 32, 128, 8), "float32", 64, 64, True, True, mods=EVERY_MOD)
    yield "simt-float32-causal1-d64-mods", kernel, SIGNATURE[types.float32]
    # packed variable-length sequences (with per-sequence key counts), keys and values in pages
    packed, paged = SequenceLayout(varlen=True, seqused=True), SequenceLayout(varlen=True, page_size=16, seqused=True)
    config = choose_wgmma_config(128, 128, 227 * 1024, SEQUENCES_REGISTERS)
    kernel = wgmma_attention_kernel(config, "bfloat16", 128, 128, True, True, True, sequences=packed)
    yield "wgmma-bfloat16-causal1-d128-varlen", kernel, SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE
    kernel = wgmma_attention_kernel(config, "bfloat16", 128, 128, True, True, True, sequences=paged)
    yield "wgmma-bfloat16-causal1-d128-paged", kernel, SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE
    # packed sequences take the dense tiles and the producer's tensor copies
    kernel = wgmma_attention_kernel(choose_wgmma_config(128, 128, 227 * 1024), "bfloat16", 128, 128, True, True, True,
                                    sequences=packed, tensor_copies=True)
    yield ("wgmma-bfloat16-causal1-d128-varlen-tensor-copies", kernel,
           SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE + (types.Array(types.uint64, 2, "A"),))
    # pages of 16 keys: a box each, its page looked up by the producer's copying thread
    kernel = wgmma_attention_kernel(choose_wgmma_config(128, 128, 227 * 1024), "bfloat16", 128, 128, True, True, True,
                                    sequences=paged, tensor_copies=True)
    yield ("wgmma-bfloat16-causal1-d128-paged-tensor-copies", kernel,
           SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE + (types.Array(types.uint64, 2, "A"),))
    # persistent blocks over packed sequences and over pages: the producer's first warp follows the ring for the tails
    for name, layout in (("varlen", packed), ("paged", paged)):
        kernel = wgmma_attention_kernel(WgmmaConfig(128, 2, 2, producer=True, persistent=True), "bfloat16", 128, 128,
                                        True, True, True, sequences=layout, tensor_copies=True)
        yield (f"wgmma-bfloat16-causal1-d128-{name}-persistent-tensor-copies", kernel,
               SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE + (types.Array(types.uint64, 2, "A"),))
    kernel = mma_attention_kernel(choose_mma_config(128, 128, 227 * 1024), "float16", 128, 128, True, True,
                                  sequences=paged)
    yield "mma-float16-causal1-d128-paged", kernel, SIGNATURE[types.uint16] + SEQUENCE_SIGNATURE
    kernel = simt_attention_kernel(SimtConfig(64, 32, 128, 8), "float32", 64, 64, True, True, sequences=paged)
    yield "simt-float32-causal1-d64-paged", kernel, SIGNATURE[types.float32] + SEQUENCE_SIGNATURE
    # the backward at head dim 128: a producer warpgroup copies the query tiles and adds the dQ tiles
    config = choose_backward_wgmma_config(128, 128, 227 * 1024)
    yield ("backward-wgmma-bfloat16-causal1-d128", backward_wgmma_kernel(config, "bfloat16", 128, 128, True),
           backward_wgmma_signature(config))
    # key splits merged through distributed shared memory by a cluster of a query tile's blocks
    clustered = mma_attention_kernel(choose_mma_config(64, 64, 227 * 1024), "float16", 64, 64, True, True,
                                     split=True, cluster_merge=True)
    yield "cluster-mma-attention", clustered, ATTENTION_SPLIT_SIGNATURE
    # split launches whose last block merges and resets its ticket counter for the next launch
    ring = {stages: DecodeConfig(stages, MMA_ROWS, MMA_SPLITTING, decode_mma_shared_bytes(128, 128, stages))
            for stages in (2, 3)}
    yield ("split-decode-mma", decode_mma_kernel("float16", 128, 128, 4, 1, ring[3], paged=False, has_seqlens=False,
                                                 split=True, write_lse=False), DECODE_SIGNATURE)
    yield ("split-decode-simt", decode_kernel("float16", 128, 128, 4, 1, DecodeConfig(None, 16, SIMT_SPLITTING, 0),
                                              paged=False, has_seqlens=True, split=True, write_lse=False,
                                              vector_loads=True), DECODE_SIGNATURE)
    yield ("split-mma-attention",
           mma_attention_kernel(choose_mma_config(64, 64, 227 * 1024), "float16", 64, 64, False, False, True),
           ATTENTION_SPLIT_SIGNATURE)
    unproduced = next(c for c in wgmma_configs(64, 64) if not c.producer)
    yield ("split-wgmma-attention", wgmma_attention_kernel(unproduced, "float16", 64, 64, False, True, True, split=True),
           ATTENTION_SPLIT_SIGNATURE)
    # a paged cache: page indices copied into shared memory tiles ahead of their keys
    yield ("paged-decode-mma", decode_mma_kernel("float16", 128, 128, 4, 1, ring[2], paged=True, has_seqlens=True,
                                                 split=False, write_lse=False), DECODE_SIGNATURE)
    yield ("paged-decode-mma-mods", decode_mma_kernel("bfloat16", 128, 128, 8, 1, ring[2], paged=True, has_seqlens=True,
                                                      split=False, write_lse=False, mods=EVERY_MOD), DECODE_SIGNATURE)


def training_and_mla_variants():
    """``(name, kernel, signature)`` of the backward's tensor-core kernels (the configurations chosen on an
    sm_90 GPU) and the MLA decode kernel of DeepSeek's sizes, which ``--resources`` reports too."""
    limits = {"cc": (9, 0), "max_shared": 227 * 1024}
    backward = BACKWARD_SIGNATURE
    for dtype in ("float16", "bfloat16"):
        for head_dim in (64, 128):
            config = choose_backward_wgmma_config(head_dim, head_dim, limits["max_shared"])
            yield (f"backward-wgmma-{dtype}-causal1-d{head_dim}",
                   backward_wgmma_kernel(config, dtype, head_dim, head_dim, True), backward_wgmma_signature(config))
            config = choose_backward_config(head_dim, head_dim, limits["max_shared"])
            yield (f"backward-mma-{dtype}-causal1-d{head_dim}",
                   backward_mma_kernel(config, dtype, head_dim, head_dim, True), backward)
    config = choose_backward_wgmma_config(128, 128, limits["max_shared"])
    yield ("backward-wgmma-bfloat16-causal1-d128-mods",
           backward_wgmma_kernel(config, "bfloat16", 128, 128, True, EVERY_MOD), backward_wgmma_signature(config))
    yield ("backward-dq-rows-bfloat16-d128", dq_rows_kernel(config, "bfloat16", 128),
           (types.Array(types.float32, 3, "A"), _U16))
    yield ("backward-dq-rows-bfloat16-d128-varlen",
           dq_rows_kernel(config, "bfloat16", 128, SequenceLayout(varlen=True)),
           (types.Array(types.float32, 3, "A"), _U16, SEQUENCE_SIGNATURE[0]))
    yield ("backward-wgmma-bfloat16-causal1-d128-varlen",
           backward_wgmma_kernel(config, "bfloat16", 128, 128, True, sequences=SequenceLayout(varlen=True)),
           backward_wgmma_signature(config, SEQUENCE_SIGNATURE[:2]))
    mla = (*(_U16_3,) * 4, _I32, types.Array(types.int32, 1, "A"), _U16_3, types.Array(types.float32, 2, "A"),
           types.Array(types.float32, 5, "A"), types.Array(types.float32, 4, "A"), types.float32)
    for heads in (16, 128):
        config = mla_default_config(512, 64, limits["cc"], heads)
        yield (f"mla-float16-{heads}-heads", mla_decode_kernel("float16", 512, 64, config, split=False, write_lse=False),
               mla)


def main():
    results = {}
    for name, kernel, signature in variants():
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        results[name] = report(ptx)
    json.dump(results, sys.stdout)


def linked_resources(kernel, signature):
    """``(registers, spill store bytes, spill load bytes, wgmma serialized)`` of ``kernel`` compiled as numba does
    on an sm_90 GPU: LTO-IR from NVVM for compute_90a, linked by nvJitLink for sm_90a under the kernel's register
    limit. ``wgmma serialized``: ptxas waits for each wgmma before issuing the next (its performance warning
    "wgmma.mma_async instructions are serialized", C7512, C7515, or in CUDA 13.5 C7519, whose code CUDA 13.0
    gives a note that serializes nothing), as it does when the registers cannot hold the products in flight,
    where other instructions may define an accumulator while its product is in flight, or where a branch it
    cannot prove the same across a warp decides whether products are issued."""
    from cuda.bindings import nvjitlink

    ltoir, _ = cuda.compile(kernel.py_func, signature, device=False, cc=(9, 0, "a"), opt=True, abi="numba",
                            output="ltoir")
    options = ["-arch=sm_90a", "-lto", "-verbose"]
    if kernel.targetoptions.get("max_registers"):
        options.append(f"-maxrregcount={kernel.targetoptions['max_registers']}")
    handle = nvjitlink.create(len(options), options)
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ltoir, len(ltoir), "kernel")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    log = log.decode(errors="replace")
    registers = re.search(r"Used (\d+) registers", log)
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    return int(registers.group(1)), int(stores), int(loads), "instructions are serialized" in log


def resources():
    from numba.cuda.cudadrv import nvvm

    print(f"NVVM {'.'.join(map(str, nvvm.NVVM().get_version()))}, sm_90a, link-time optimised")
    print(f"{'kernel':40} {'registers':>9} {'spill stores':>12} {'spill loads':>11} {'wgmma serialized':>16}")
    for name, kernel, signature in (*variants(), *training_and_mla_variants()):
        registers, stores, loads, serialized = linked_resources(kernel, signature)
        print(f"{name:40} {registers:9d} {stores:12d} {loads:11d} {'yes' if serialized else 'no':>16}", flush=True)


if __name__ == "__main__":
    resources() if "--resources" in sys.argv[1:] else main()
