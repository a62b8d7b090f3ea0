"""A few attention calls of awkward sizes, for ``compute-sanitizer`` on a GPU machine:

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tests/sanitize_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_cases.py

(``--report-api-errors no``: cuda-bindings probes driver entry points with ``cuGetProcAddress``,
whose expected failures memcheck would count as errors.)
"""

import numpy as np
import torch

import numattn
from numattn import reference

CASES = [  # dtype, causal, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, head_dim_v, misaligned out
    ("float16", True, 1, 4, 2, 77, 77, 64, 64, False),
    ("bfloat16", False, 1, 2, 1, 33, 130, 128, 128, False),
    ("float32", True, 2, 2, 2, 50, 19, 40, 72, False),
    ("float16", False, 1, 2, 2, 20, 45, 256, 256, False),
    ("bfloat16", True, 1, 2, 2, 90, 70, 64, 128, False),  # head_dim_v > head_dim: output from registers
    ("float16", True, 1, 2, 1, 100, 300, 128, 128, True),  # output rows not 16-byte aligned
    # medium: many blocks, many key tiles, pipelined copies
    ("bfloat16", True, 1, 8, 2, 1024, 1024, 128, 128, False),
    ("float16", False, 2, 4, 4, 500, 700, 64, 64, False),
]

DECODE_CASES = [  # dtype, batch, heads_q, heads_kv, max_seqlen, head_dim, page_size (0: contiguous)
    ("float16", 3, 8, 2, 700, 128, 0),
    ("bfloat16", 2, 4, 4, 333, 64, 16),
    ("float16", 2, 6, 2, 100, 128, 1),
    ("float32", 2, 4, 2, 90, 40, 0),
]


def run_decode_cases(rng):
    from numattn.bench import paged_copy

    for dtype, b, hq, hkv, length, d, page_size in DECODE_CASES:
        tdtype = getattr(torch, dtype)
        q = torch.from_numpy(rng.standard_normal((b, hq, d), dtype=np.float32)).to("cuda", tdtype)
        k, v = (torch.from_numpy(rng.standard_normal((b, hkv, length, d), dtype=np.float32)).to("cuda", tdtype)
                for _ in range(2))
        lengths = torch.from_numpy(rng.integers(0, length + 1, size=b).astype(np.int32)).cuda()
        if page_size:
            k_pages, v_pages, table = paged_copy(torch, k, v, page_size)
            o = numattn.paged_decode(q, k_pages, v_pages, table, lengths)
        else:
            o = numattn.decode(q, k, v, seqlens=lengths)
        err = np.abs(o.double().cpu().numpy() - reference.decode(q, k, v, seqlens=lengths)).max()
        print(f"decode {dtype} q={tuple(q.shape)} cache={tuple(k.shape)} page_size={page_size}: max err {err:.2e}")
        assert err < 2e-2


if __name__ == "__main__":
    rng = np.random.default_rng()
    for dtype, causal, b, hq, hkv, sq, skv, d, dv, misaligned in CASES:
        tdtype = getattr(torch, dtype)
        q = torch.from_numpy(rng.standard_normal((b, hq, sq, d), dtype=np.float32)).to("cuda", tdtype)
        k = torch.from_numpy(rng.standard_normal((b, hkv, skv, d), dtype=np.float32)).to("cuda", tdtype)
        v = torch.from_numpy(rng.standard_normal((b, hkv, skv, dv), dtype=np.float32)).to("cuda", tdtype)
        out = torch.empty(b, hq, sq, dv + misaligned, device="cuda", dtype=tdtype)[..., int(misaligned) :]
        o, lse = numattn.attention(q, k, v, causal=causal, return_lse=True, out=out)
        err = np.abs(o.double().cpu().numpy() - reference.attention(q, k, v, causal=causal)).max()
        print(f"{dtype} causal={causal} q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}: max err {err:.2e}")
        assert err < 2e-2
    run_decode_cases(rng)
