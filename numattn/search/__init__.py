"""Kernel-graph superoptimizer: graph IR (graph.py), matching (match.py), candidate plans (plans.py),
verification (interpret.py, verify.py), ranking (tune.py), cache (cache.py); pipeline.py ties them."""

from .graph import DType, KernelGraph, Tensor, bfloat16, float16, float32, new_kernel_graph

__all__ = ["DType", "KernelGraph", "Tensor", "new_kernel_graph", "float16", "bfloat16", "float32"]
