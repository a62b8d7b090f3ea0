"""Packed variable-length batches on one GPU: ``numattn.attention_varlen`` against the padded batch.

    python benchmarks/varlen.py [--json PATH]

Forward passes, bf16, causal, Hq 32, Hkv 8, D128, default arguments, fresh random inputs; each timed as
the median of CUDA-event timings with the L2 cache flushed, after the GPU's clocks are warmed, the
contenders in turns over eleven rounds.

* Equal lengths, B8 L2048: ``attention_varlen`` on the packed rows, on keys in shuffled pages of 16 and of
  64 rows (paged prefill), against ``numattn.attention`` on the padded batch (layout ``"bshd"``: the same
  memory as the packed rows). The target: within 3% of the padded batch. The best SDPA backend on the
  padded batch (cuDNN included, contiguous ``bhsd``) for scale.
* Uneven lengths, 16 sequences of 256 to 4096 rows (a fixed draw): ``attention_varlen`` against
  ``numattn.attention`` on the batch padded to the longest sequence, which computes every padding row.

Outputs are compared before timing: the packed and paged results against the padded batch's rows.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROUNDS = 11  # rounds of the contenders in turns (each a median of 10 timings): at 5 a run's ratios moved by ±4%


def packed_offsets(torch, lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")


def shuffled_pages(torch, k, v, lengths, page_size):
    """Packed ``k``, ``v`` ``[total, H, D]`` copied into shuffled pages ``[num_pages, page_size, H, D]``, with
    the page table."""
    pages_per_sequence = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_sequence)
    order = torch.randperm(num_pages, device="cuda").to(torch.int32)
    table = torch.zeros(len(lengths), max(pages_per_sequence), dtype=torch.int32, device="cuda")
    k_pages = torch.zeros(num_pages, page_size, *k.shape[1:], dtype=k.dtype, device="cuda")
    v_pages = torch.zeros_like(k_pages)
    row, page = 0, 0
    for b, n in enumerate(lengths):
        table[b, : pages_per_sequence[b]] = order[page : page + pages_per_sequence[b]]
        for j in range(pages_per_sequence[b]):
            rows = min(page_size, n - j * page_size)
            k_pages[order[page + j], :rows] = k[row + j * page_size : row + j * page_size + rows]
            v_pages[order[page + j], :rows] = v[row + j * page_size : row + j * page_size + rows]
        row, page = row + n, page + pages_per_sequence[b]
    return k_pages, v_pages, table


def equal_lengths(torch, timed_in_turns, batch=8, seqlen=2048, heads_q=32, heads_kv=8, head_dim=128):
    import numattn
    from numattn.bench import backend_context, sdpa_backends_taking

    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen, heads_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    lengths = [seqlen] * batch
    cu = packed_offsets(torch, lengths)
    q_packed, k_packed, v_packed = (x.view(-1, *x.shape[2:]) for x in (q, k, v))
    used = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    calls = {"padded batch": lambda: numattn.attention(q, k, v, causal=True, layout="bshd"),
             "packed": lambda: numattn.attention_varlen(q_packed, k_packed, v_packed, cu, cu, seqlen, seqlen,
                                                        causal=True)}
    for page_size in (16, 64):
        k_pages, v_pages, table = shuffled_pages(torch, k_packed, v_packed, lengths, page_size)
        calls[f"paged {page_size}"] = (
            lambda k_pages=k_pages, v_pages=v_pages, table=table: numattn.attention_varlen(
                q_packed, k_pages, v_pages, cu, None, seqlen, seqlen, causal=True, page_table=table, seqused_k=used))
    padded = calls["padded batch"]().view(-1, heads_q, head_dim)
    errors = {name: float((call() - padded).abs().max()) for name, call in calls.items() if name != "padded batch"}
    q_bhsd, k_bhsd, v_bhsd = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    for name in sdpa_backends_taking(torch, q_bhsd, k_bhsd, v_bhsd, is_causal=True, enable_gqa=True):
        def sdpa(name=name):
            with backend_context(name):
                torch.nn.functional.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=True,
                                                                 enable_gqa=True)
        calls[f"SDPA {name} (padded)"] = sdpa
    times = timed_in_turns(torch, calls, rounds=ROUNDS)
    base = times["padded batch"]
    return [{"case": f"B{batch} L{seqlen} Hq{heads_q} Hkv{heads_kv} D{head_dim} bf16 causal, {name}", "ms": ms,
             "over_padded": ms / base, "max_abs_difference": errors.get(name)} for name, ms in times.items()]


def uneven_lengths(torch, timed_in_turns, heads_q=32, heads_kv=8, head_dim=128):
    import numattn

    lengths = [int(n) for n in np.random.default_rng(7).integers(256, 4097, 16)]
    longest, total = max(lengths), sum(lengths)
    dtype = torch.bfloat16
    q = torch.randn(total, heads_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    cu = packed_offsets(torch, lengths)
    padded = [torch.zeros(len(lengths), longest, x.shape[1], head_dim, device="cuda", dtype=dtype) for x in (q, k, v)]
    for b, n in enumerate(lengths):  # each sequence at the end of its padded row (causal is bottom-right aligned)
        for x, pad in zip((q, k, v), padded, strict=True):
            pad[b, longest - n :] = x[cu[b] : cu[b] + n]
    calls = {"padded to the longest": lambda: numattn.attention(*padded, causal=True, layout="bshd"),
             "packed": lambda: numattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)}
    packed = calls["packed"]()
    error = 0.0
    for b, n in enumerate(lengths[:4]):  # a few sequences alone
        rows = slice(int(cu[b]), int(cu[b]) + n)
        alone = numattn.attention(q[None, rows], k[None, rows], v[None, rows], causal=True, layout="bshd")[0]
        error = max(error, float((packed[rows] - alone).abs().max()))
    times = timed_in_turns(torch, calls, rounds=ROUNDS)
    label = f"16 sequences of {min(lengths)}..{longest} rows ({total} in all), Hq{heads_q} Hkv{heads_kv} D{head_dim}"
    return [{"case": f"{label}, {name}", "ms": ms, "over_padded": ms / times["padded to the longest"],
             "max_abs_difference": error if name == "packed" else None} for name, ms in times.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and the run's facts here")
    args = parser.parse_args(argv)
    import torch
    from variants import timed_in_turns

    from numattn.bench import run_facts

    rows = equal_lengths(torch, timed_in_turns) + uneven_lengths(torch, timed_in_turns)
    for row in rows:
        difference = "" if row["max_abs_difference"] is None else f"  max |diff| {row['max_abs_difference']:.3g}"
        print(f"{row['case']:80} {row['ms']:8.3f} ms  {row['over_padded']:6.3f}x{difference}")
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run_facts(torch), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
