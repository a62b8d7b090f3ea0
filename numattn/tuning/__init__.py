"""The tuning layer, between the kernels and the ops: the tuning cache on disk (``cache.py``), the
configurations it holds per problem (``store.py``) and the cost models that order candidates
(``models.py``). The ops read tuned configurations here; ``numattn.tune`` and the superoptimizer
(``numattn.search``) write them."""
