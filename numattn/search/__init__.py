"""Kernel-graph superoptimizer (graph IR, matching, candidates, verification, tuning, cache)."""
