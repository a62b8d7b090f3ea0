"""The tuning cache on disk: one JSON file of search results keyed by graph, shapes, device and version.

The directory is ``$NUMATTN_CACHE_DIR`` when set, else the platform's cache
directory; ``previous_checkpoint`` names a file to use instead. A file that
cannot be read or parsed is ignored with a warning and rewritten.
"""

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import warnings

from ..kernels.attention_mma import MmaConfig
from ..kernels.attention_simt import SimtConfig
from ..kernels.attention_wgmma import WgmmaConfig
from ..kernels.mla import MlaConfig

_CONFIGS = {c.__name__: c for c in (MmaConfig, SimtConfig, WgmmaConfig, MlaConfig)}
FILE_NAME = "superoptimize.json"


def cache_path(previous_checkpoint=None):
    if previous_checkpoint is not None:
        return os.fspath(previous_checkpoint)
    root = os.environ.get("NUMATTN_CACHE_DIR")
    if not root:
        if sys.platform == "win32":
            base = os.environ.get("LOCALAPPDATA", os.path.expanduser("~"))
        elif sys.platform == "darwin":
            base = os.path.expanduser("~/Library/Caches")
        else:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = os.path.join(base, "numattn")
    return os.path.join(root, FILE_NAME)


def cache_key(graph, device, version):
    """Hash of the graph's canonical form (which holds its shapes and dtypes), the device's name and
    compute capability, and the numattn version."""
    text = f"{graph.canonical()}\n{device['name']}\n{device['cc']}\n{version}"
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path):
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring unreadable numattn tuning cache {path}: {e}", stacklevel=3)
        return {}


def load(path, key):
    """The stored entry for ``key`` (a dict with "plan" and "table"), or None."""
    entry = _read(path).get(key)
    if entry is None:
        return None
    try:
        plan = entry["plan"]
        config = plan["config"]
        decoded = None if config is None else _CONFIGS[config["type"]](**config["fields"])
        return {"kind": plan["kind"], "config": decoded, "k_layout": plan["k_layout"], "splits": int(plan["splits"]),
                "table": list(entry["table"])}
    except (KeyError, TypeError, ValueError) as e:
        warnings.warn(f"ignoring stale numattn tuning cache entry in {path}: {e!r}", stacklevel=3)
        return None


def store(path, key, plan, table):
    """Add or replace ``key``'s entry; written to a temporary file and renamed into place."""
    data = _read(path)
    config = None if plan.config is None else {
        "type": type(plan.config).__name__, "fields": dataclasses.asdict(plan.config)}
    data[key] = {"plan": {"kind": plan.kind, "config": config, "k_layout": plan.k_layout, "splits": plan.splits},
                 "table": table}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
