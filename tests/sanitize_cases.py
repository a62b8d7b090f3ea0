"""A few attention calls of awkward sizes, for ``compute-sanitizer`` on a GPU machine:

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_cases.py
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
