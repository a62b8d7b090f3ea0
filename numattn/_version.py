"""numattn's version, in one place: the package, its metadata and the tuning cache's keys read it."""

__version__ = "0.2.0"
