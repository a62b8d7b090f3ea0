"""Kernel-graph superoptimizer: graph IR (graph.py), matching (match.py), candidate plans (plans.py),
verification (interpret.py, verify.py), ranking (tune.py); pipeline.py ties them; the tuning cache is
``numattn.tuning``. This module is the face users see: ``new_kernel_graph`` and ``superoptimize``."""

from .graph import DType, Graph, Tensor, bfloat16, float16, float32
from .pipeline import superoptimize as _superoptimize


class KernelGraph(Graph):
    """A kernel graph under construction (``numattn.new_kernel_graph()``), Mirage's ``KNGraph``."""

    def superoptimize(self, config="attention", backend=None, warmup_iters=16, profile_iters=1000,
                      previous_checkpoint=None, verbose=True):
        """Search fused, equivalence-checked kernels for this graph; returns a callable ``OptimizedGraph``.

        See ``numattn.search.pipeline.superoptimize``."""
        return _superoptimize(self, config=config, backend=backend, warmup_iters=warmup_iters,
                              profile_iters=profile_iters, previous_checkpoint=previous_checkpoint, verbose=verbose)


def new_kernel_graph() -> KernelGraph:
    """An empty ``KernelGraph``."""
    return KernelGraph()


def superoptimize(graph: KernelGraph, config: str = "attention", **options):
    """``graph.superoptimize(config=config, **options)``, called as Mirage's ``mi.superoptimize(graph)``."""
    if not isinstance(graph, KernelGraph):
        raise TypeError(f"superoptimize takes a kernel graph (numattn.new_kernel_graph()), got {type(graph).__name__}")
    return graph.superoptimize(config=config, **options)


__all__ = ["DType", "KernelGraph", "Tensor", "new_kernel_graph", "superoptimize", "float16", "bfloat16", "float32"]
