import time, statistics, ctypes
import torch, numpy as np
import numattn
from numattn.ops import attention as A
from cuda.bindings import driver

def per_call(fn, n=20000):
    for _ in range(200): fn()
    res = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        res.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(res)

q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
numattn.attention(q, k, v)
key = (A._signature(q), A._signature(k), A._signature(v), A._signature(None), bool, False, type(None), None, "bhsd", bool, False)
plan = A._PLANS[key]
p = plan.problem
rows = {
 "full call": lambda: numattn.attention(q, k, v),
 "signature x3": lambda: (A._signature(q), A._signature(k), A._signature(v)),
 "key build+lookup": lambda: A._PLANS[(A._signature(q), A._signature(k), A._signature(v), A._signature(None), False.__class__, False, None.__class__, None, "bhsd", False.__class__, False)],
 "q.device": lambda: q.device,
 "q.get_device()": lambda: q.get_device(),
 "q.stride()": lambda: q.stride(),
 "q.shape": lambda: q.shape,
 "hash(sig)": lambda: hash(A._signature(q)),
 "plan() only": lambda: plan(q, k, v, None),
 "torch.empty": lambda: torch.empty(p.out_shape, dtype=torch.float16, device=plan._device),
 "torch.empty_like(q)": lambda: torch.empty_like(q),
 "current_device": lambda: torch.cuda.current_device(),
 "raw stream": lambda: plan._stream(0),
 "data_ptr x4": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr()),
}
kern = plan.kernel
args = plan.args
ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.empty_like(q).data_ptr(), 0)
rows["kernel.launch"] = lambda: kern.launch(0, plan.grid, plan.block, args, ptrs)
vals = args.values
def fill():
    for s, ptr in zip(args.pointer_slots, ptrs): vals[s] = ptr
rows["numpy slot fill x5"] = fill
cvals = (ctypes.c_uint64 * len(vals)).from_buffer(vals)
def cfill():
    for s, ptr in zip(args.pointer_slots, ptrs): cvals[s] = ptr
rows["ctypes slot fill x5"] = cfill
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
