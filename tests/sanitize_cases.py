"""A few attention calls of awkward sizes, for ``compute-sanitizer`` on a GPU machine:

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tests/sanitize_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_cases.py

(``python tests/sanitize_cases.py mla``: the MLA decode cases alone; ``split``: the key-split and
transposed-K variants of the ``mma.sync`` kernel alone; ``backward``: the backward kernels alone.)

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


MLA_CASES = [  # dtype, batch, heads, rank, rope, max_seqlen, page_size, configuration (None: default)
    ("bfloat16", 2, 20, 512, 64, 300, 1, None),
    ("float16", 3, 70, 256, 64, 200, 7, None),
    ("float16", 2, 16, 512, 64, 260, 16, "duplicated"),  # the wgmma kernel's other schedule
    ("bfloat16", 2, 20, 512, 64, 300, 1, "64-row"),  # the wgmma kernel with 64-row tiles in two stages
    ("bfloat16", 2, 16, 512, 0, 150, 3, "mma"),  # the mma.sync kernel
    ("bfloat16", 600, 32, 512, 64, 150, 16, "persistent"),  # 600 sequences, one block per SM, two Q halves
    ("float16", 200, 40, 512, 64, 150, 16, "ordinary"),  # unsplit: output rows staged in the Q tile
]


def run_mla_cases(rng):
    from numattn.configs.mla import MlaConfig
    from numattn.ops import mla as module

    configs = {"duplicated": MlaConfig(32, 3, 8, "duplicated", True), "64-row": MlaConfig(64, 2, 8, "duplicated", True),
               "mma": MlaConfig(16, 4, 8, "sharded"), "persistent": MlaConfig(32, 4, 8, "shared", True, True),
               "ordinary": MlaConfig(32, 4, 8, "shared", True)}
    for dtype, b, h, rank, rope, length, page_size, name in MLA_CASES:
        tdtype = getattr(torch, dtype)
        pages = -(-length // page_size)
        shapes = [(b, h, rank), (b, h, rope), (b * pages + 2, page_size, rank), (b * pages + 2, page_size, rope)]
        arrays = [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdtype) for s in shapes]
        table = torch.from_numpy(rng.permutation(b * pages + 2)[: b * pages].reshape(b, pages).astype(np.int32)).cuda()
        lengths = torch.from_numpy(rng.integers(0, length + 1, size=b).astype(np.int32)).cuda()
        args = (*arrays, table, lengths)
        if name is None:
            o = numattn.mla_decode(*args, scale=0.1)
        else:
            splits = 1 if name in ("persistent", "ordinary") else 2
            o = module._TorchPlan(module.validate(*args, 0.1, False), configs[name], splits)(*args)
        err = np.abs(o.double().cpu().numpy() - reference.mla_decode(*args, scale=0.1)).max()
        where = f"heads={h} rank={rank} rope={rope} page_size={page_size}"
        print(f"mla {dtype} {where} {name or 'default'}: max err {err:.2e}")
        assert err < 2e-2


def run_split_cases(rng):
    """The ``mma.sync`` kernel over runs of keys merged by each query tile's last block, K stored as rows of keys or
    transposed (keys contiguous, the last run of 8 keys partial)."""
    from numattn.configs.attention import MmaConfig
    from numattn.ops.attention import make_plan, validate

    for causal in (False, True):
        for transposed in (False, True):
            q = torch.from_numpy(rng.standard_normal((2, 4, 150, 64), dtype=np.float32)).to("cuda", torch.float16)
            shape = (2, 2, 64, 424) if transposed else (2, 2, 420, 64)
            k = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", torch.float16)
            k = k.transpose(2, 3)[:, :, :419] if transposed else k[:, :, :419]
            v = torch.from_numpy(rng.standard_normal((2, 2, 419, 64), dtype=np.float32)).to("cuda", torch.float16)
            for splits in (1, 3):
                problem = validate(q, k, v, None, causal, 0.125, "bhsd", True)
                o, lse = make_plan(problem, MmaConfig(64, 4, 1, True), splits)(q, k, v, None)
                ref = reference.attention(q, k, v, causal=causal, scale=0.125)
                err = np.abs(o.double().cpu().numpy() - ref).max()
                print(f"mma causal={causal} transposed K={transposed} splits={splits}: max err {err:.2e}")
                assert err < 2e-2


BACKWARD_CASES = [  # dtype, causal, batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim
    ("bfloat16", True, 1, 4, 2, 200, 150, 128),  # wgmma (sm_90), two warpgroups; rows that see no key
    ("float16", False, 2, 2, 1, 70, 130, 64),  # wgmma, one warpgroup
    ("bfloat16", True, 1, 2, 2, 100, 90, 96),  # mma.sync
    ("float32", True, 1, 2, 1, 40, 50, 32),  # CUDA cores
]


def run_backward_cases(rng):
    """numattn.torch.attention's gradients against float64 autograd."""
    import numattn.torch as nt

    for dtype, causal, b, hq, hkv, sq, skv, d in BACKWARD_CASES:
        shapes = [(b, hq, sq, d), (b, hkv, skv, d), (b, hkv, skv, d)]
        leaves = [torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", getattr(torch, dtype))
                  .requires_grad_() for s in shapes]
        o = nt.attention(*leaves, causal=causal)
        do = torch.randn_like(o)
        o.backward(do)
        exact = [x.detach().double().requires_grad_() for x in leaves]
        group = hq // hkv
        s = exact[0] @ exact[1].repeat_interleave(group, 1).transpose(-1, -2) / d ** 0.5
        if causal:
            mask = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(skv - sq)
            s = s.masked_fill(~mask, float("-inf"))
        (torch.softmax(s, -1).nan_to_num(0.0) @ exact[2].repeat_interleave(group, 1)).backward(do.double())
        errs = [(x.grad.double() - e.grad).abs().max().item() / max(1.0, e.grad.abs().max().item())
                for x, e in zip(leaves, exact, strict=True)]
        print(f"backward {dtype} causal={causal} q={shapes[0]} k={shapes[1]}: max grad errors {errs}")
        assert max(errs) < 2e-2


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
    import sys

    rng = np.random.default_rng()
    only = {"mla": run_mla_cases, "split": run_split_cases, "backward": run_backward_cases, "decode": run_decode_cases}
    if sys.argv[1:2] and sys.argv[1] in only:
        only[sys.argv[1]](rng)
        sys.exit()
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
    run_split_cases(rng)
    run_backward_cases(rng)
    run_decode_cases(rng)
    run_mla_cases(rng)
