import time, statistics, ctypes
import torch, numpy as np
import numattn
from numattn.ops import attention as A
from cuda.bindings import driver

def per_call(fn, n=200, rounds=200):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n): fn()
        res.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(res)

q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
a = torch.randn(16, device="cuda")
numattn.attention(q, k, v)
key = (A._signature(q), A._signature(k), A._signature(v), A._signature(None), bool, False, type(None), None, "bhsd", bool, False)
plan = A._PLANS[key]
p = plan.problem
dev = plan._device
f16 = torch.float16
shape = p.out_shape
rows = {
 "full call": lambda: numattn.attention(q, k, v),
 "full call return_lse": lambda: numattn.attention(q, k, v, return_lse=True),
 "torch.add": lambda: torch.add(a, a),
 "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
 "plan() only": lambda: plan(q, k, v, None),
 "key build+lookup": lambda: A._PLANS[(A._signature(q), A._signature(k), A._signature(v), A._signature(None), False.__class__, False, None.__class__, None, "bhsd", False.__class__, False)],
 "flat key tuple+hash": lambda: hash((q.dtype, q.shape, q.stride(), q.get_device(), k.dtype, k.shape, k.stride(), k.get_device(), v.dtype, v.shape, v.stride(), v.get_device(), None, bool, False, None.__class__, None, "bhsd", bool, False)),
 "hash(q.shape)": lambda: hash(q.shape),
 "hash(q.dtype)": lambda: hash(q.dtype),
 "hash(q.device)": lambda: hash(q.device),
 "tuple(q.shape)": lambda: tuple(q.shape),
 "torch.empty kw": lambda: torch.empty(shape, dtype=f16, device=dev),
 "q.new_empty(shape)": lambda: q.new_empty(shape),
 "torch.empty_like(q)": lambda: torch.empty_like(q),
 "q.new_empty f32": lambda: q.new_empty((1,1,16), dtype=torch.float32),
}
kern = plan.kernel
args = plan.args
ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.empty_like(q).data_ptr(), 0)
rows["kernel.launch"] = lambda: kern.launch(0, plan.grid, plan.block, args, ptrs)
fn = kern.function
rows["cuLaunchKernel only"] = lambda: driver.cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, kern.shared_bytes, 0, args.address, 0)
libcuda = ctypes.CDLL("libcuda.so.1")
launch = libcuda.cuLaunchKernel
launch.restype = ctypes.c_int
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
fh = int(fn)
rows["ctypes cuLaunchKernel"] = lambda: launch(fh, 1, 1, 1, 128, 1, 1, kern.shared_bytes, 0, args.address, None)
for name, fn_ in rows.items():
    print(f"{name:28s} {per_call(fn_):7.2f} us")
# GPU time of the tiny kernel
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(100): numattn.attention(q, k, v)
e.record(); e.synchronize(); print("gpu us per tiny call", s.elapsed_time(e) * 10)
