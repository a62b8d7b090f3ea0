import time, statistics
import torch
import numattn
from numattn.bench import host_overhead_us

q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.float16) for _ in range(3))
for calls in (20, 50, 200):
    for lse in (False, True):
        us = host_overhead_us(lambda: numattn.attention(q, k, v, return_lse=lse), calls=calls, rounds=100)
        print(f"calls/round {calls:4d} return_lse {lse}: {us:6.2f} us")
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for lse in (False, True):
    torch.cuda.synchronize(); s.record()
    for _ in range(100): numattn.attention(q, k, v, return_lse=lse)
    e.record(); e.synchronize(); print("gpu us per tiny call, lse", lse, s.elapsed_time(e) * 10)
x = torch.randn(16, device="cuda")
print("q.new_empty f32", host_overhead_us(lambda: q.new_empty((1, 1, 16), dtype=torch.float32)))
