"""GPU benchmarks: numattn against torch SDPA backends in one process (needs torch with CUDA).

``python -m numattn bench`` prints, per shape, the median kernel time (CUDA
events around each call, L2 flushed before each, after warm-up) and TFLOP/s of
numattn and of SDPA's flash, cuDNN and memory-efficient backends on the same
inputs, then the host overhead per call: back-to-back calls on tiny inputs
timed with a host clock, next to torch's own per-op overhead. With ``--decode``
it adds the decode targets: ``decode`` and ``paged_decode`` (pages of 1, 16 and
64 keys) against SDPA's GQA backends, in µs and effective GB/s; with ``--mla``,
``mla_decode`` in FlashInfer's GB/s metric next to the device copy rate; with
``--graph``, Mirage's GQA graph against every SDPA backend on the inputs it is
fastest with (contiguous 4-D, transposes outside the timed region); with
``--checked``, the decode functions' default ``check=True`` against
``check=False``; ``--only`` leaves out the attention table and host overhead.
SDPA backends are selected with ``sdpa_kernel`` around a whole timing, so the
timed calls are plain SDPA calls.
"""

import contextlib
import json
import os
import statistics
import time


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("numattn bench needs torch with a CUDA GPU")
    return torch


def cuda_time_ms(fn, warmup=3, repeat=20, flush_l2=True):
    """Median milliseconds of ``fn()`` on the GPU, each call between two CUDA events."""
    torch = _torch()
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_overhead_us(calls, per_round=50, rounds=200):
    """Median host microseconds per call of each of ``calls`` (name -> callable) over rounds of
    back-to-back calls, the callables taking turns round by round (a drifting host state then
    touches them all alike).

    Rounds are short enough that the GPU's launch queue never fills (which
    would make the host wait for the GPU); the GPU drains between rounds,
    outside the timed region.
    """
    torch = _torch()
    for fn in calls.values():
        for _ in range(per_round):
            fn()
    torch.cuda.synchronize()
    per_call = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            per_call[name].append((time.perf_counter() - start) / per_round * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in per_call.items()}


def attention_flops(batch, heads, seqlen_q, seqlen_kv, head_dim, head_dim_v, causal):
    """Matmul FLOPs of attention forward; causal counts the visible half (bottom-right aligned)."""
    if causal:
        visible = sum(max(0, min(seqlen_kv, i + 1 + seqlen_kv - seqlen_q)) for i in range(seqlen_q))
    else:
        visible = seqlen_q * seqlen_kv
    return 2 * batch * heads * visible * (head_dim + head_dim_v)


def _sdpa_backends(torch):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def bench_attention(shapes, dtypes=("float16", "bfloat16", "float32"), causals=(False, True)):
    """Rows of {shape, dtype, causal, <impl>_ms, <impl>_tflops} for numattn and SDPA backends."""
    torch = _torch()
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numattn

    rows = []
    for batch, heads, seqlen, head_dim in shapes:
        for dtype in dtypes:
            for causal in causals:
                tdtype = getattr(torch, dtype)
                q, k, v = (
                    torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=tdtype) for _ in range(3)
                )
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim, causal)
                row = {"shape": (batch, heads, seqlen, head_dim), "dtype": dtype, "causal": causal}
                impls = {"numattn": lambda: numattn.attention(q, k, v, causal=causal)}
                for name in _sdpa_backends(torch):
                    impls[name] = lambda: sdpa(q, k, v, is_causal=causal)
                _time_into(row, impls, flops)
                rows.append(row)
    return rows


def _time_into(row, impls, flops, repeat=20):
    """``row[<name>_ms]`` and ``row[<name>_tflops]`` for each ``name: fn`` of ``impls`` (``cuda_time_ms``,
    SDPA backends' calls inside their ``sdpa_kernel`` context); an implementation that raises (an SDPA
    backend that does not support the case) gets None and its error."""
    for name, fn in impls.items():
        try:
            with backend_context(name):
                ms = cuda_time_ms(fn, repeat=repeat)
        except RuntimeError as exc:
            row[f"{name}_ms"] = None
            row[f"{name}_error"] = str(exc).splitlines()[0][:80]
            continue
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9


def backend_context(name):
    """``sdpa_kernel`` restricted to SDPA backend ``name`` (a key of ``_sdpa_backends``), entered around a
    whole timing so that the timed calls are plain SDPA calls; a null context for other names."""
    torch = _torch()
    backends = _sdpa_backends(torch)
    if name not in backends:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends[name])


def bench_host_overhead():
    """Host µs per call on tiny inputs: numattn, SDPA (default backend choice) and a plain torch op."""
    torch = _torch()
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numattn

    q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    a = torch.randn(16, device="cuda")
    return host_overhead_us({
        "numattn.attention": lambda: numattn.attention(q, k, v),
        "numattn.attention, return_lse": lambda: numattn.attention(q, k, v, return_lse=True),
        "numattn.attention, causal, bshd": lambda: numattn.attention(q, k, v, causal=True, layout="bshd"),
        "torch sdpa": lambda: sdpa(q, k, v),
        "torch.add": lambda: torch.add(a, a),
    })


def bench_configs(shape, dtype, causal, configs):
    """Rows of {config, ms, tflops, regs, local} for the attention kernels under each tile configuration.

    ``configs`` may mix ``WgmmaConfig``, ``MmaConfig`` and ``SimtConfig``; a configuration the
    device cannot compile or launch gives a row with its ``error``.
    """
    torch = _torch()
    from numattn.ops.attention import make_plan, validate

    batch, heads, seqlen, head_dim = shape
    q, k, v = (torch.randn(*shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
    problem = validate(q, k, v, None, causal, None, "bhsd", False)
    flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim, causal)
    rows = []
    for config in configs:
        try:
            plan = make_plan(problem, config)
            ms = cuda_time_ms(lambda: plan(q, k, v, None))
        except Exception as exc:  # a configuration the device cannot hold
            rows.append({"config": config, "error": str(exc).splitlines()[0][:100]})
            continue
        attrs = plan.launch.kernel.attributes
        rows.append({"config": config, "ms": ms, "tflops": flops / ms / 1e9, "regs": attrs.regs, "local": attrs.local})
    return rows


# (batch, heads_q, heads_kv, max_seqlen, head_dim, dtype): the decode targets
DECODE_SHAPES = [(64, 32, 8, 4096, 128, "float16"), (8, 32, 8, 32768, 128, "bfloat16"), (1, 32, 8, 8192, 128, "float16")]


def paged_copy(torch, k, v, page_size):
    """``(k_pages, v_pages, page_table)``: caches [B, Hkv, L, D] scattered over shuffled nhd pages of ``page_size`` keys."""
    batch, heads, length, dim = k.shape
    per_seq = -(-length // page_size)
    table = torch.randperm(batch * per_seq, device=k.device).reshape(batch, per_seq).int()
    pages = []
    for cache in (k, v):
        full = torch.zeros(batch, heads, per_seq * page_size, cache.shape[3], device=k.device, dtype=cache.dtype)
        full[:, :, :length] = cache
        paged = torch.empty(batch * per_seq, page_size, heads, cache.shape[3], device=k.device, dtype=cache.dtype)
        paged[table.long().flatten()] = (
            full.reshape(batch, heads, per_seq, page_size, -1).permute(0, 2, 3, 1, 4).reshape(-1, page_size, heads, cache.shape[3])
        )
        pages.append(paged)
    return pages[0], pages[1], table


def bench_decode(shapes=DECODE_SHAPES, page_sizes=(1, 16, 64)):
    """Rows of {shape, dtype, <impl>_us, <impl>_gbs} for numattn.decode, paged_decode per page size and SDPA backends.

    GB/s is the effective rate: K and V bytes of the valid keys over the kernel time.
    """
    torch = _torch()
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numattn

    rows = []
    for batch, heads_q, heads_kv, length, dim, dtype in shapes:
        tdtype = getattr(torch, dtype)
        q = torch.randn(batch, heads_q, dim, device="cuda", dtype=tdtype)
        k, v = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=tdtype) for _ in range(2))
        lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * batch * heads_kv * length * dim * k.element_size()
        row = {"shape": (batch, heads_q, heads_kv, length, dim), "dtype": dtype}
        impls = {"numattn": lambda q=q, k=k, v=v: numattn.decode(q, k, v, check=False)}
        for page_size in page_sizes:
            k_pages, v_pages, table = paged_copy(torch, k, v, page_size)
            impls[f"paged{page_size}"] = (
                lambda kp=k_pages, vp=v_pages, t=table: numattn.paged_decode(q, kp, vp, t, lengths, check=False)
            )
        q4 = q.unsqueeze(2).contiguous()
        for name in _sdpa_backends(torch):
            impls[name] = lambda: sdpa(q4, k, v, enable_gqa=True)
        for name, fn in impls.items():
            try:
                with backend_context(name):
                    ms = cuda_time_ms(fn)
            except RuntimeError as exc:
                row[f"{name}_us"] = None
                row[f"{name}_error"] = str(exc).splitlines()[0][:80]
                continue
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_gbs"] = kv_bytes / ms / 1e6
        rows.append(row)
    return rows


def bench_decode_host_overhead():
    """Host µs per call of decode and paged_decode on a tiny cache (B1 Hq8 Hkv2 L256 D128 fp16, one launch
    without key splits), of decode on W3 (key splits merged in the same launch), the same through plans
    (``decode_plan``), next to torch SDPA and a plain torch op. Rounds of 50 calls queue less GPU work
    than the launch queue holds, so the GPU never holds the host back."""
    torch = _torch()
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numattn

    q = torch.randn(1, 8, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = paged_copy(torch, k, v, 16)
    a = torch.randn(16, device="cuda")
    q4 = q.unsqueeze(2)
    out = torch.empty_like(q)
    batch, heads_q, heads_kv, length, dim, _ = DECODE_SHAPES[2]
    q_w3 = torch.randn(batch, heads_q, dim, device="cuda", dtype=torch.float16)
    k_w3, v_w3 = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    step, step_w3 = numattn.decode_plan(q, k, v), numattn.decode_plan(q_w3, k_w3, v_w3)
    paged_step = numattn.paged_decode_plan(q, k_pages, v_pages, table, lengths)
    return host_overhead_us({
        "numattn.decode": lambda: numattn.decode(q, k, v, check=False),
        "numattn.decode, W3 (split)": lambda: numattn.decode(q_w3, k_w3, v_w3, check=False),
        "numattn.decode, seqlens": lambda: numattn.decode(q, k, v, seqlens=lengths, check=False),
        "numattn.decode, out=": lambda: numattn.decode(q, k, v, check=False, out=out),
        "numattn.paged_decode": lambda: numattn.paged_decode(q, k_pages, v_pages, table, lengths, check=False),
        "decode_plan": lambda: step(q),
        "decode_plan, W3 (split)": lambda: step_w3(q_w3),
        "decode_plan, out=": lambda: step(q, out=out),
        "paged_decode_plan": lambda: paged_step(q, check=False),
        "torch sdpa (GQA)": lambda: sdpa(q4, k, v, enable_gqa=True),
        "torch.add": lambda: torch.add(a, a),
    })


# FlashInfer's MLA decode benchmark: fp16, pages of one row, contiguous page indices; (batch, heads, seqlen)
MLA_SHAPES = [(768, h, n) for n in (1024, 2048) for h in (16, 32, 64)] + [(64, 16, 32768)]


def copy_gbs(nbytes=1 << 30):
    """Device-to-device copy rate in GB/s (bytes read plus bytes written over the time), the reference
    that the MLA targets are stated against."""
    torch = _torch()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_time_ms(lambda: dst.copy_(src)) / 1e6


def bench_mla(shapes=MLA_SHAPES, rank=512, rope=64, configs=None):
    """Rows of {shape, config, us, gbs} for numattn.mla_decode in FlashInfer's metric:
    ``bytes = 2·B·(H·(R + P + R) + L·(R + P))`` (fp16 queries, output and latent rows) over the time.

    ``configs`` (``MlaConfig`` list) times each configuration through the plan; None times the default.
    """
    torch = _torch()
    import numattn
    from numattn.ops.mla import planned, validate

    rows = []
    for batch, heads, seqlen in shapes:
        q_nope = torch.randn(batch, heads, rank, device="cuda", dtype=torch.float16)
        q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.float16)
        ckv = torch.randn(batch * seqlen, 1, rank, device="cuda", dtype=torch.float16)
        kpe = torch.randn(batch * seqlen, 1, rope, device="cuda", dtype=torch.float16)
        table = torch.arange(batch * seqlen, device="cuda", dtype=torch.int32).reshape(batch, seqlen)
        lengths = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
        args = (q_nope, q_pe, ckv, kpe, table, lengths)
        nbytes = 2 * batch * (heads * (2 * rank + rope) + seqlen * (rank + rope))
        for config in configs or [None]:
            try:
                if config is None:
                    ms = cuda_time_ms(lambda: numattn.mla_decode(*args, scale=0.1, check=False))
                    plan = planned(validate(*args, 0.1, False))
                    config_name = f"default {plan.config}"
                else:
                    config_name = str(config)
                    plan = planned(validate(*args, 0.1, False), config)
                    ms = cuda_time_ms(lambda: plan(*args))
                # a persistent configuration runs its persistent grid only without splits
                config_name += f", {plan.splits} split{'s' if plan.splits > 1 else ''}"
            except Exception as exc:  # a configuration the device cannot hold
                rows.append({"shape": (batch, heads, seqlen), "config": str(config), "error": str(exc)[:100]})
                continue
            rows.append({"shape": (batch, heads, seqlen), "config": config_name, "us": ms * 1e3,
                         "gbs": nbytes / ms / 1e6})
        del ckv, kpe
    return rows


def print_decode_table(rows):
    impls = [name[:-3] for name in rows[0] if name.endswith("_us")]
    print(f"{'B,Hq,Hkv,L,D':>20} {'dtype':>8} " + " ".join(f"{i + ' µs':>12} {'GB/s':>6}" for i in impls))
    for row in rows:
        cells = []
        for impl in impls:
            us = row.get(f"{impl}_us")
            cells.append(f"{us:12.1f} {row[f'{impl}_gbs']:6.0f}" if us is not None else f"{'n/a':>12} {'':>6}")
        shape = ",".join(map(str, row["shape"]))
        print(f"{shape:>20} {row['dtype']:>8} " + " ".join(cells))


def matmul_peak_tflops(n=8192, dtype="bfloat16"):
    """Measured dense tensor-core rate: an n×n×n torch matmul on random data."""
    torch = _torch()
    a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
    return 2 * n**3 / cuda_time_ms(lambda: a @ b, flush_l2=False) / 1e9


# (batch, heads, seqlen, head_dim): the head-dim × length table (16k tokens per batch),
# then the targets B8 H16 L2048 D64 fp16 and B4 H32 L4096 D128 bf16
TABLE_SHAPES = [(b, 16, seqlen, d) for d in (64, 128, 256) for b, seqlen in ((16, 1024), (4, 4096), (1, 16384))]
QUICK_SHAPES = [(4, 16, 1024, 64), (2, 16, 1024, 128)]


def print_attention_table(rows, peak=None):
    impls = ["numattn", "flash", "cudnn", "efficient"]
    header = f"{'B,H,L,D':>18} {'dtype':>8} {'causal':>6} " + " ".join(f"{i + ' ms':>13} {'TF/s':>6}" for i in impls)
    print(header + (f" {'numattn/peak':>12}" if peak else ""))
    for row in rows:
        cells = []
        for impl in impls:
            ms = row.get(f"{impl}_ms")
            cells.append(f"{ms:13.3f} {row[f'{impl}_tflops']:6.1f}" if ms is not None else f"{'n/a':>13} {'':>6}")
        shape = ",".join(map(str, row["shape"]))
        fraction = f" {row['numattn_tflops'] / peak:12.1%}" if peak and row.get("numattn_ms") else ""
        print(f"{shape:>18} {row['dtype']:>8} {str(row['causal']):>6} " + " ".join(cells) + fraction)


TRAINING_SHAPES = [(4, 32, 4096, 128), (4, 32, 4096, 64)]  # the training target and its D = 64 twin


def bench_training(shapes=TRAINING_SHAPES, dtype="bfloat16", causals=(False, True)):
    """Rows of {shape, dtype, causal, <impl>_ms, <impl>_tflops} for forward + backward (one
    ``o.backward(do)`` after the forward, gradients of q, k, v) with numattn.torch.attention and the
    SDPA backends; TFLOP/s count the backward as 2.5 forwards. ``numattn_fwd_ms`` times the forward
    alone (with the log-sum-exp the backward needs)."""
    torch = _torch()
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numattn
    import numattn.torch as nt

    rows = []
    for batch, heads, seqlen, head_dim in shapes:
        for causal in causals:
            tdtype = getattr(torch, dtype)
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=tdtype, requires_grad=True)
                       for _ in range(3))
            do = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=tdtype)
            flops = 3.5 * attention_flops(batch, heads, seqlen, seqlen, head_dim, head_dim, causal)
            row = {"shape": (batch, heads, seqlen, head_dim), "dtype": dtype, "causal": causal}

            def step(forward):
                q.grad = k.grad = v.grad = None
                forward(q, k, v).backward(do)

            impls = {"numattn": lambda: step(lambda q, k, v: nt.attention(q, k, v, causal=causal))}
            for name in _sdpa_backends(torch):
                impls[name] = lambda: step(lambda q, k, v: sdpa(q, k, v, is_causal=causal))
            _time_into(row, impls, flops, repeat=10)
            row["numattn_fwd_ms"] = cuda_time_ms(
                lambda: numattn.attention(q.detach(), k.detach(), v.detach(), causal=causal, return_lse=True), repeat=10)
            rows.append(row)
    return rows


def mirage_gqa_graph(b):
    """Mirage's GQA benchmark graph for batch parameter ``b``: Q (2b, 256, 64), K (2b, 64, 4096),
    V (2b, 4096, 64), fp16, softmax without a scale or a max."""
    import numattn as mi

    g = mi.new_kernel_graph()
    Q = g.new_input(dims=(2 * b, 256, 64), dtype=mi.float16)
    K = g.new_input(dims=(2 * b, 64, 4096), dtype=mi.float16)
    V = g.new_input(dims=(2 * b, 4096, 64), dtype=mi.float16)
    E = g.exp(g.matmul(Q, K))
    g.mark_output(g.matmul(g.div(E, g.reduction(E, 2)), V))
    return g


def loop_us(fn, calls=1000, warmup=20):
    """Per-call µs of ``calls`` back-to-back calls timed with CUDA events around the loop (Mirage's method)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def warm_clocks(torch, seconds=1.0):
    """Keep the GPU busy with matmuls for about ``seconds``, so that the loops timed next run at the
    clocks of a busy GPU (timed cold, a 25 µs kernel measured up to 43 µs)."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()


def sdpa_backends_taking(torch, q, k, v, **options):
    """The SDPA backends that take these inputs (each tried once inside its ``sdpa_kernel`` context)."""
    names = []
    for name in _sdpa_backends(torch):
        try:
            with backend_context(name):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
        except RuntimeError:  # a backend that does not take these inputs
            continue
        names.append(name)
    return names


def alternating_loop_us(fns, rounds=5):
    """``{name: median µs per call}`` of ``loop_us`` for each of ``fns`` (``{name: fn}``; a name of an SDPA
    backend times its loop inside that backend's ``backend_context``, entered once per loop), timed in
    turn over ``rounds`` rounds after the clocks are warmed, so that a drift of the GPU's clocks reaches
    every contender alike."""
    torch = _torch()
    warm_clocks(torch)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with backend_context(name):
                times[name].append(loop_us(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_graph(batches=(1, 8)):
    """The superoptimized Mirage GQA graph on the graph's inputs, against each SDPA backend on the
    inputs it is fastest with (contiguous 4-D ``[1, 2b, seqlen, head_dim]``, the keys transposed outside
    the timed region) and torch eager on the graph's inputs; the search time uncached and from the
    cache (a fresh cache directory)."""
    import tempfile

    torch = _torch()
    F = torch.nn.functional
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["NUMATTN_CACHE_DIR"] = cache_dir
        for b in batches:
            row = {"b": b}
            t0 = time.perf_counter()
            opt = mirage_gqa_graph(b).superoptimize(config="attention", verbose=False)
            row["search_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            mirage_gqa_graph(b).superoptimize(config="attention", verbose=False)
            row["cached_search_s"] = time.perf_counter() - t0
            row["winner"] = opt.plan.describe()
            q, k, v = (torch.rand(t.dims, device="cuda", dtype=torch.float16) * 2 - 1 for t in opt.graph.inputs)
            ref = F.scaled_dot_product_attention(q.double(), k.transpose(1, 2).double(), v.double(), scale=1.0)
            row["max_error"] = (opt(q, k, v)[0].double() - ref).abs().max().item()
            q4, k4, v4 = (x.unsqueeze(0).contiguous() for x in (q, k.transpose(1, 2), v))

            def eager():
                e = torch.exp(torch.matmul(q, k))
                return torch.matmul(e / e.sum(2, keepdim=True), v)

            def sdpa():
                return F.scaled_dot_product_attention(q4, k4, v4, scale=1.0)

            backends = sdpa_backends_taking(torch, q4, k4, v4, scale=1.0)
            timed = alternating_loop_us({"numattn": lambda: opt(q, k, v), **dict.fromkeys(backends, sdpa), "eager": eager})
            row["numattn_us"], row["eager_us"] = timed["numattn"], timed["eager"]
            row.update({f"{name}_us": timed.get(name) for name in _sdpa_backends(torch)})
            row["best_sdpa"] = min(backends, key=timed.get)
            rows.append(row)
    return rows


# the default (checked) call against check=False: mla_decode in FlashInfer's benchmark layout (rank 512,
# rope 64, fp16; (batch, heads, seqlen, page_size)), paged_decode (pages of 16) and decode with seqlens on B64 Hq32 Hkv8 L4096 D128 fp16
CHECKED_MLA_SHAPES = [(768, 64, 2048, 1), (768, 16, 1024, 64)]


def checked_calls(torch):
    """``{name: call(check)}``: the calls whose default ``check=True`` ``bench_checked`` measures, on
    fresh random inputs."""
    import numattn

    calls = {}
    for batch, heads, seqlen, page in CHECKED_MLA_SHAPES:
        pages = -(-seqlen // page)
        q_nope = torch.randn(batch, heads, 512, device="cuda", dtype=torch.float16)
        q_pe = torch.randn(batch, heads, 64, device="cuda", dtype=torch.float16)
        ckv = torch.randn(batch * pages, page, 512, device="cuda", dtype=torch.float16)
        kpe = torch.randn(batch * pages, page, 64, device="cuda", dtype=torch.float16)
        table = torch.randperm(batch * pages, device="cuda").int().reshape(batch, pages)
        lengths = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
        args = (q_nope, q_pe, ckv, kpe, table, lengths)
        calls[f"mla B{batch} H{heads} L{seqlen} pages of {page}"] = (
            lambda check, args=args: numattn.mla_decode(*args, scale=0.1, check=check))
    batch, heads_q, heads_kv, length, dim, dtype = DECODE_SHAPES[0]
    tdtype = getattr(torch, dtype)
    q = torch.randn(batch, heads_q, dim, device="cuda", dtype=tdtype)
    k, v = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=tdtype) for _ in range(2))
    lengths = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    k_pages, v_pages, table = paged_copy(torch, k, v, 16)
    calls["decode(seqlens=) W1"] = lambda check: numattn.decode(q, k, v, seqlens=lengths, check=check)
    calls["paged_decode W1 pages of 16"] = (
        lambda check: numattn.paged_decode(q, k_pages, v_pages, table, lengths, check=check))
    return calls


def bench_checked(rounds=3):
    """Rows of {call, default_us, unchecked_us, default_loop_us, unchecked_loop_us}: each of
    ``checked_calls`` with its default ``check=True`` and with ``check=False``, timed per call
    (``cuda_time_ms``) and as 200 back-to-back calls (``loop_us``, where a host synchronisation would
    show); the two take turns for ``rounds`` rounds, and each gets the median of its rounds."""
    rows = []
    for name, call in checked_calls(_torch()).items():
        times = {key: [] for key in ("default_us", "unchecked_us", "default_loop_us", "unchecked_loop_us")}
        for _ in range(rounds):
            for label, check in (("default", True), ("unchecked", False)):
                times[f"{label}_us"].append(cuda_time_ms(lambda: call(check)) * 1e3)
                times[f"{label}_loop_us"].append(loop_us(lambda: call(check), calls=200))
        rows.append({"call": name, **{key: statistics.median(values) for key, values in times.items()}})
    return rows


# the first call of each case in a fresh process (``bench_cold_start``): inputs, then the call
COLD_START_CASES = {
    "attention bf16 D128 causal": (
        "q, k, v = (torch.randn(2, 16, 1024, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))",
        "numattn.attention(q, k, v, causal=True)"),
    "attention fp16 D64": (
        "q, k, v = (torch.randn(2, 16, 1024, 64, device='cuda', dtype=torch.float16) for _ in range(3))",
        "numattn.attention(q, k, v)"),
    "decode fp16 D128": (
        "q = torch.randn(8, 32, 128, device='cuda', dtype=torch.float16)\n"
        "k, v = (torch.randn(8, 8, 4096, 128, device='cuda', dtype=torch.float16) for _ in range(2))",
        "numattn.decode(q, k, v)"),
    "mla_decode (512, 64)": (
        "q_nope, q_pe = torch.randn(64, 16, 512, device='cuda', dtype=torch.float16), "
        "torch.randn(64, 16, 64, device='cuda', dtype=torch.float16)\n"
        "ckv, kpe = torch.randn(64 * 16, 64, 512, device='cuda', dtype=torch.float16), "
        "torch.randn(64 * 16, 64, 64, device='cuda', dtype=torch.float16)\n"
        "table = torch.arange(64 * 16, device='cuda', dtype=torch.int32).reshape(64, 16)\n"
        "lengths = torch.full((64,), 1000, device='cuda', dtype=torch.int32)",
        "numattn.mla_decode(q_nope, q_pe, ckv, kpe, table, lengths, scale=0.1)"),
    "numattn.torch.attention fwd + bwd bf16 D128 GQA": (
        "import numattn.torch\n"
        "q = torch.randn(2, 32, 1024, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "k, v = (torch.randn(2, 8, 1024, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(2))",
        "numattn.torch.attention(q, k, v, causal=True).sum().backward()"),
    "torch SDPA bf16 D128 causal": (
        "q, k, v = (torch.randn(2, 16, 1024, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))",
        "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)"),
}

_COLD_START_SCRIPT = """
import json, time
start = time.perf_counter()
import numba.cuda, torch
torch.cuda.init()
torch.empty(1, device='cuda')
imported_torch = time.perf_counter()
import numattn
imported = time.perf_counter()
{setup}
torch.cuda.synchronize()
times = []
for _ in range(2):
    t0, cpu0 = time.perf_counter(), time.process_time()
    {call}
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0, time.process_time() - cpu0))
from numattn.kernels.launch import COMPILES
print(json.dumps({{"torch_numba_import_s": imported_torch - start, "numattn_import_s": imported - imported_torch,
                  "first_call_s": times[0][0], "first_call_cpu_s": times[0][1], "second_call_s": times[1][0],
                  "compiles": COMPILES}}))
"""


def cold_start_run(case, cache):
    """One fresh process running ``COLD_START_CASES[case]`` with the kernel cache ``cache`` (a directory, or
    "off"): ``{torch_numba_import_s, numattn_import_s, first_call_s, first_call_cpu_s, second_call_s,
    compiles}`` (``first_call_cpu_s``: the processor time of the process's threads during the first call)."""
    import subprocess
    import sys

    setup, call = COLD_START_CASES[case]
    script = _COLD_START_SCRIPT.format(setup=setup, call=call)
    env = dict(os.environ, NUMATTN_KERNEL_CACHE=str(cache))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"cold-start case {case!r} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_cold_start(cases=tuple(COLD_START_CASES), repeats=3):
    """Rows of {case, cold, warm, off, off_again, compile_s}: each case's times in fresh processes, one after
    another: with an empty kernel cache (every kernel compiled and stored), with the cache the first one
    filled, and ``repeats`` times with the cache off (compiled again: ``off``, then ``off_again``'s list);
    ``kernels``: how many kernels the case compiled; each process's ``compiles``: ``(label, seconds)`` of the
    kernels it compiled itself (with the cache off, every one). ``compile_s``: each kernel's label and its
    compile times in every process that compiled it, each a first-ever compile (a process compiles from
    nothing), which vary by a third from process to process on a machine's shared processors."""
    import tempfile
    from pathlib import Path

    from numattn.kernels import kernel_cache

    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as directory:
            row = {"case": case, "cold": cold_start_run(case, directory)}
            row["kernels"] = len(kernel_cache.entries(Path(directory)))  # the kernels the call compiled
            row["warm"] = cold_start_run(case, directory)
        off = [cold_start_run(case, "off") for _ in range(repeats)]
        row["off"], row["off_again"] = off[0], off[1:]
        row["compile_s"] = {}
        for run in [row["cold"], *off]:
            for label, seconds in run["compiles"]:
                row["compile_s"].setdefault(label, []).append(seconds)
        rows.append(row)
    return rows


def package_digest(package=None):
    """The first 16 hex digits of a SHA-256 over the package's Python sources (``numattn``'s, by default): the
    code a run measured, whatever git says of the checkout it ran from (a copy's metadata can lag its files).
    ``git archive REV numattn`` of the revision that holds the same files gives the same digest."""
    import hashlib
    from pathlib import Path

    import numattn

    package = Path(package or Path(numattn.__file__).parent)
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def run_facts(torch):
    """What a stored result needs beside its numbers: the date, the command, the GPU, numattn's version and
    the source revision it ran (``git describe`` where the package sits in a git checkout) with the digest
    of its sources (``package_digest``), the versions of torch, CUDA, numba and numba-cuda."""
    import datetime
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    import numattn

    try:
        revision = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(numattn.__file__).parent,
                                  capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    script = Path(sys.argv[0])  # numattn's __main__, or a script such as benchmarks/varlen.py
    program = ["-m", "numattn"] if script.name == "__main__.py" else [f"{script.parent.name}/{script.name}"]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *program, *sys.argv[1:]]),
            "gpu": torch.cuda.get_device_name(), "numattn": numattn.__version__, "revision": revision,
            "sources": package_digest(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda, "numba": metadata.version("numba"), "numba-cuda": metadata.version("numba-cuda")}


def main(args):
    torch = _torch()
    import numattn
    from numattn.kernels.launch import device_limits, resource_report

    device = device_limits(torch.cuda.current_device())
    print(f"numattn {numattn.__version__}, torch {torch.__version__}, {device['name']} (sm_{device['cc'][0]}{device['cc'][1]})")
    results = {"device": device, "run": run_facts(torch)}
    if not args.only:
        peak = matmul_peak_tflops()
        print(f"bf16 matmul 8192³ (tensor-core reference): {peak:.1f} TFLOP/s")
        if args.quick:
            rows = bench_attention(QUICK_SHAPES)
        else:
            rows = bench_attention(TABLE_SHAPES, dtypes=("bfloat16",))
            rows += bench_attention([(8, 16, 2048, 64)], dtypes=("float16",), causals=(False,))
            rows += bench_attention([(4, 32, 4096, 128)], dtypes=("bfloat16",))
            rows += bench_attention([(2, 16, 2048, 64)], dtypes=("float32",))
        print_attention_table(rows, peak)
        overhead = bench_host_overhead()
        print("host overhead per call (µs, median of back-to-back calls on tiny inputs):")
        for name, us in overhead.items():
            print(f"  {name:32} {us:7.2f}")
        results.update({"matmul_tflops": peak, "attention": rows, "host_overhead_us": overhead})
    if args.decode:
        results["decode"] = bench_decode()
        print_decode_table(results["decode"])
        results["decode_host_overhead_us"] = bench_decode_host_overhead()
        print("decode host overhead per call (µs, tiny cache):")
        for name, us in results["decode_host_overhead_us"].items():
            print(f"  {name:32} {us:7.2f}")
    if args.mla:
        from numattn.configs.mla import MlaConfig

        results["copy_gbs"] = copy_gbs()
        # the default, the wgmma kernel's shared schedule on either grid and its other score schedule
        # (sm_90), and the mma.sync kernel with either schedule (sm_80 and later)
        schedules = [
            MlaConfig(32, 4, 8, "shared", True),
            MlaConfig(32, 4, 8, "shared", True, persistent=True),
            MlaConfig(32, 3, 8, "duplicated", True),
            MlaConfig(16, 4, 4, "duplicated"),
            MlaConfig(16, 4, 8, "sharded"),
        ]
        results["mla"] = bench_mla(configs=[None, *schedules])
        print(f"MLA decode (FlashInfer's metric; device copy {results['copy_gbs']:.0f} GB/s):")
        for row in results["mla"]:
            cell = f"{row['us']:9.1f} µs {row['gbs']:6.0f} GB/s" if "us" in row else row["error"]
            print(f"  B,H,L {str(row['shape']):18} {row['config']:72} {cell}")
    if args.training:
        results["training"] = bench_training()
        print("forward + backward, bf16 (TFLOP/s count the backward as 2.5 forwards):")
        print_attention_table(results["training"])
        for row in results["training"]:
            print(f"  {row['shape']} causal={row['causal']}: numattn forward alone {row['numattn_fwd_ms']:.3f} ms")
    if args.graph:
        results["graph"] = bench_graph()
        print("Mirage GQA graph (µs per call, 1000 back-to-back calls; SDPA on contiguous 4-D inputs; search s):")
        for row in results["graph"]:
            sdpa = "  ".join(f"{name} {row[f'{name}_us']:7.1f}" for name in _sdpa_backends(torch)
                             if row[f"{name}_us"] is not None)
            print(f"  b={row['b']}: numattn {row['numattn_us']:7.1f}  SDPA {sdpa} (best: {row['best_sdpa']})  eager "
                  f"{row['eager_us']:7.1f}  search {row['search_s']:5.1f} s, cached {row['cached_search_s']:.3f} s, "
                  f"max error {row['max_error']:.1e}; {row['winner']}")
    if args.checked:
        results["checked"] = bench_checked()
        print("default check=True against check=False (µs: median per call, L2 flushed | 200 back-to-back calls):")
        for row in results["checked"]:
            print(f"  {row['call']:58} {row['default_us']:8.1f} {row['unchecked_us']:8.1f} "
                  f"({row['default_us'] / row['unchecked_us'] - 1:+.1%}) | {row['default_loop_us']:8.1f} "
                  f"{row['unchecked_loop_us']:8.1f} ({row['default_loop_us'] / row['unchecked_loop_us'] - 1:+.1%})")
    if args.cold_start:
        results["cold_start"] = bench_cold_start(repeats=args.repeats)
        print("first call in a fresh process (s; the kernel cache empty | filled by the first process | off), "
              "import of numattn after torch and numba:")
        for row in results["cold_start"]:
            print(f"  {row['case']:48} {row['cold']['first_call_s']:7.2f} | {row['warm']['first_call_s']:6.3f} | "
                  f"{row['off']['first_call_s']:7.2f}   {row['kernels']} kernels   second call "
                  f"{row['warm']['second_call_s'] * 1e3:6.2f} ms   import {row['warm']['numattn_import_s']:.2f} s")
            for label, seconds in row["compile_s"].items():  # every process that compiled the kernel
                print(f"      {statistics.median(seconds):6.2f} s  ({', '.join(f'{t:.2f}' for t in seconds)})  {label}")
    print(resource_report())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0
