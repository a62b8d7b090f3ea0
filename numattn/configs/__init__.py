"""Kernel configurations, apart from the kernels: each kernel family's configuration class, candidate
table, register estimate, device fit test and default choice. Above ``numattn.kernels`` (whose constants
they read) and below the ops that choose a configuration and hand it to a kernel factory."""
