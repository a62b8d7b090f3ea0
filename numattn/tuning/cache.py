"""The tuning cache on disk: one JSON file of search results keyed by graph, shapes, device and version.

The directory is ``$NUMATTN_CACHE_DIR`` when set, else the platform's cache
directory; ``previous_checkpoint`` names a file to use instead. A file that
cannot be read or parsed is ignored with a warning and rewritten; an entry that
is not a valid plan (a hand-edited one, say) is ignored with a warning, as if
absent. Writers take an exclusive lock on the sibling file ``<name>.lock`` to
read, merge and replace the file, so that concurrent processes keep each
other's entries; a cache that cannot be written (a file where a directory
should be, no permission) is left as it is, with a warning.
"""

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import reprlib
import stat
import sys
import warnings

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

from ..configs.attention import MmaConfig, SimtConfig, WgmmaConfig
from ..configs.mla import MlaConfig
from ..kernels.split_merge import MAX_SPLITS

_CONFIGS = {c.__name__: c for c in (MmaConfig, SimtConfig, WgmmaConfig, MlaConfig)}
FILE_NAME = "superoptimize.json"


class CacheWarning(UserWarning):
    """A tuning cache file that could not be read or written, or an entry of it that was ignored."""


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
        warnings.warn(f"ignoring unreadable numattn tuning cache {path}: {e}", CacheWarning, stacklevel=3)
        return {}


def load(path, key):
    """The stored entry for ``key`` (a dict with "kind", "config", "k_layout", "splits" and "table"), or
    None: also, with a warning, for an entry that is not a valid plan."""
    entry = _read(path).get(key)
    if entry is None:
        return None
    try:
        return _decode(entry)
    except (KeyError, TypeError, ValueError) as e:
        reason = f"missing {e}" if isinstance(e, KeyError) else e
        warnings.warn(f"ignoring invalid numattn tuning cache entry in {path}: {reason}", CacheWarning, stacklevel=3)
        return None


def _choice(name, value, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be {' or '.join(map(repr, options))}, got {value!r}")
    return value


def _decode(entry):
    """A stored entry's plan fields and table, checked: ValueError naming what is wrong, KeyError for a
    missing part, TypeError for a part that is not an object."""
    plan, table = entry["plan"], entry["table"]
    splits = plan["splits"]
    if type(splits) is not int or not 1 <= splits <= MAX_SPLITS:  # bool is an int subclass: not a count
        raise ValueError(f"splits must be an int in [1, {MAX_SPLITS}], got {splits!r}")
    if not isinstance(table, list) or not all(isinstance(row, dict) for row in table):
        raise ValueError(f"table must be a list of objects, got {reprlib.repr(table)}")
    config = plan["config"]
    return {"kind": _choice("kind", plan["kind"], ("fused", "unfused")),
            "config": None if config is None else _config(config),
            "k_layout": _choice("k_layout", plan["k_layout"], ("copy", "strided")), "splits": splits, "table": table}


def _config(config):
    """The tile configuration of a stored ``{"type", "fields"}``: the fields of the class named, ints
    positive, bools and strings as such, then the class's own checks."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be null or an object, got {config!r}")
    name, fields = config["type"], config["fields"]
    if not isinstance(name, str) or name not in _CONFIGS:
        raise ValueError(f"config type must be one of {', '.join(_CONFIGS)}, got {name!r}")
    types = {f.name: f.type for f in dataclasses.fields(_CONFIGS[name])}
    if not isinstance(fields, dict) or fields.keys() != types.keys():
        raise ValueError(f"{name} fields must be {', '.join(types)}, got {fields!r}")
    for field, value in fields.items():
        expected = types[field]
        if type(value) is not expected or expected is int and value < 1:
            kind = "positive int" if expected is int else expected.__name__
            raise ValueError(f"{name} field {field} must be a {kind}, got {value!r}")
    return _CONFIGS[name](**fields)


def store(path, key, plan, table):
    """Add or replace ``key``'s entry: under an exclusive lock, the file is read, the entry merged in, and
    the result written to a temporary file renamed into place (keeping the file's mode; a new file gets
    the mode ``open`` gives, 0666 less the umask). A cache that cannot be written is left as it was, with
    a warning."""
    config = None if plan.config is None else {
        "type": type(plan.config).__name__, "fields": dataclasses.asdict(plan.config)}
    entry = {"plan": {"kind": plan.kind, "config": config, "k_layout": plan.k_layout, "splits": plan.splits},
             "table": table}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with _locked(path):
            data = _read(path)
            data[key] = entry
            _replace(path, data)
    except OSError as e:
        warnings.warn(f"could not write the numattn tuning cache {path}: {e}", CacheWarning, stacklevel=3)


@contextlib.contextmanager
def _locked(path):
    """Hold an exclusive lock on ``path + ".lock"`` (created if missing), waiting for other holders."""
    fd = os.open(os.fspath(path) + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
            yield
        else:
            while True:
                try:
                    msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                    break
                except OSError as e:  # LK_LOCK gives up after 10 tries a second apart: wait on
                    if e.errno != errno.EDEADLOCK:
                        raise
            try:
                yield
            finally:
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # before closing, as Windows asks
    finally:
        os.close(fd)


def _replace(path, data):
    """Write ``data`` to ``path + ".tmp"`` and rename it over ``path`` (readers see the old file or the new
    one), with ``path``'s mode, or for a new file the mode ``open`` gives. The caller holds the lock."""
    tmp = os.fspath(path) + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # left by a writer that died
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
