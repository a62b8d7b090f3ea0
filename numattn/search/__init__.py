"""Kernel-graph superoptimizer: graph IR (graph.py), matching (match.py), candidate plans (plans.py),
verification (interpret.py, verify.py), ranking (tune.py), cache (cache.py); pipeline.py ties them."""

from .graph import DType, KernelGraph, Tensor, bfloat16, float16, float32, new_kernel_graph


def superoptimize(graph, config="attention", **options):
    """``graph.superoptimize(config=config, **options)``, called as Mirage's ``mi.superoptimize(graph)``."""
    if not isinstance(graph, KernelGraph):
        raise TypeError(f"superoptimize takes a kernel graph (numattn.new_kernel_graph()), got {type(graph).__name__}")
    return graph.superoptimize(config=config, **options)


__all__ = ["DType", "KernelGraph", "Tensor", "new_kernel_graph", "superoptimize", "float16", "bfloat16", "float32"]
