"""Compiled kernels kept on disk, so that a new process loads them instead of compiling them again.

An entry is one file, ``<key>.kernel``: a magic line, a JSON header (the kernel's label, its entry
name, the size and SHA-256 of its cubin) and the linked cubin. The key digests everything the
cubin depends on: the sources of the kernel modules and their primitives (every file of this
package and ``_cuda.py``), the kernel function's code and the compile-time values it closes over
(tile sizes, flags, the device functions it calls, recursively), its compile options, the argument
types, the compute capability and the toolchain's versions. A source change therefore makes new
keys; old entries are simply no longer read (``python -m numattn cache clear`` removes them).

Writes are atomic (a temporary file renamed over the entry); a per-key file lock makes processes
that need the same kernel at once (ranks of one job) compile it once; an entry that cannot be read
back whole and unchanged is compiled again, with a ``KernelCacheWarning``, and replaced. Where the
directory cannot be written the kernel is still compiled and used, with one warning.

Location: ``$NUMATTN_KERNEL_CACHE`` when set (``off`` disables the cache), else
``$XDG_CACHE_HOME/numattn/kernels``, else ``~/.cache/numattn/kernels``.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import types
import warnings
from pathlib import Path

import numpy as np

MAGIC = b"numattn kernel 1\n"
SUFFIX = ".kernel"
_PACKAGE = Path(__file__).resolve().parent


class KernelCacheWarning(UserWarning):
    """A kernel-cache entry could not be used or stored; the kernel was compiled instead."""


def cache_directory():
    """The cache's directory (a ``Path``, perhaps not yet created), or None when the cache is off."""
    setting = os.environ.get("NUMATTN_KERNEL_CACHE", "").strip()
    if setting.lower() in ("off", "0", "false", "no", "none"):
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "numattn" / "kernels"


@functools.lru_cache(maxsize=None)
def source_digest(package=_PACKAGE):
    """SHA-256 of the kernel sources: every ``.py`` file under ``package`` (its subpackages too) and the
    package's ``_cuda.py``."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")) + [package.parent / "_cuda.py"]:
        digest.update(path.relative_to(package.parent).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def toolchain():
    """Versions the compiled code depends on: numba, numba-cuda, cuda-bindings and NVVM."""
    from importlib import metadata

    versions = {}
    for name in ("numba", "numba-cuda", "cuda-bindings"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    from numba.cuda.cudadrv import nvvm

    try:
        versions["nvvm"] = ".".join(map(str, nvvm.NVVM().get_version()))
    except Exception:  # noqa: BLE001  (the simulator, or no libNVVM: such a process compiles nothing)
        versions["nvvm"] = None
    return versions


def _describe(value, seen):
    """A stable text for ``value`` as a kernel's compile-time input: functions by their code and
    closures (recursively), numba dispatchers by their Python function and options, plain values by
    ``repr``. Objects whose ``repr`` carries an address are described by their type alone."""
    py_func = getattr(value, "py_func", None) or getattr(value, "__wrapped__", None)
    if py_func is not None:  # a numba dispatcher (kernel or device function; the simulator's wraps it)
        options = sorted((k, _describe(v, seen)) for k, v in getattr(value, "targetoptions", {}).items())
        return f"dispatcher({_describe(py_func, seen)}, {options})"
    if isinstance(value, types.FunctionType):
        name = f"{value.__module__}.{value.__qualname__}"
        if id(value) in seen:
            return f"function {name}"
        seen.add(id(value))
        cells = [_describe(cell.cell_contents, seen) if _filled(cell) else "<empty>" for cell in value.__closure__ or ()]
        return f"function {name} {_code_digest(value.__code__)} [{', '.join(cells)}]"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_describe(v, seen) for v in value)})"
    if isinstance(value, np.ndarray):  # its repr may elide elements
        return f"ndarray({value.dtype.str}, {value.shape}, {hashlib.sha256(value.tobytes()).hexdigest()[:16]})"
    if dataclasses.is_dataclass(value) or isinstance(value, (int, float, bool, str, bytes, type(None), np.generic, np.dtype)):
        return repr(value)
    definition = getattr(value, "_defn", None)  # a numba intrinsic: its typing-and-lowering function
    if isinstance(definition, types.FunctionType):
        return f"intrinsic({_describe(definition, seen)})"
    text = repr(value)
    if " at 0x" not in text:
        return text
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if name is None:
        raise _Undescribable(type(value).__qualname__)
    return f"{type(value).__qualname__} {getattr(value, '__module__', '')}.{name}"


class _Undescribable(Exception):
    """A kernel closes over a value that has no stable description (a key would not identify the kernel)."""


def _filled(cell):
    try:
        cell.cell_contents  # noqa: B018  (an empty cell raises)
    except ValueError:
        return False
    return True


def _code_digest(code):
    """SHA-256 of a code object's bytecode, names and constants (nested code objects included)."""
    digest = hashlib.sha256(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        digest.update(_code_digest(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    return digest.hexdigest()[:16]


def kernel_key(dispatcher, argtypes, cc):
    """The cache key of ``dispatcher`` compiled for ``argtypes`` on compute capability ``cc``; None, with a
    warning, for a kernel that closes over a value without a stable description (it is then compiled in
    every process rather than risk loading another kernel's code)."""
    try:
        described = _describe(dispatcher, set())
    except _Undescribable as exc:
        warnings.warn(f"numattn does not cache kernel {getattr(dispatcher, '__name__', dispatcher)}: it closes over "
                      f"a {exc} value", KernelCacheWarning, stacklevel=2)
        return None
    text = json.dumps([source_digest(), toolchain(), described, [str(t) for t in argtypes], list(cc)])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Entry:
    """A compiled kernel: its label, entry (function) name and cubin."""

    label: str
    entry_name: str
    cubin: bytes


def cached_kernel(key, build):
    """The ``Entry`` stored under ``key``, or ``build()``'s, stored for later processes. Processes asking
    for one key at once wait for the first to build it. A None key builds without the cache."""
    directory = cache_directory()
    if directory is None or key is None:
        return build()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = _lock_file(directory, key)
    except OSError as exc:
        _warn_unwritable(directory, exc)
        return build()
    with lock:  # closes the file, which releases the lock
        path = directory / (key + SUFFIX)
        entry = read_entry(path)
        if entry is None:
            entry = build()
            _write_entry(path, entry)
        return entry


def _lock_file(directory, key):
    """The open lock file of ``key``, locked exclusively against other processes (``flock``, where the
    platform has it; elsewhere processes may compile one kernel twice, harmlessly)."""
    handle = open(directory / (key + ".lock"), "a+b")  # noqa: SIM115  (the caller closes it)
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX)
    except ImportError:
        pass
    return handle


def read_entry(path):
    """The ``Entry`` in ``path``; None when there is none, or, with a warning, when it is damaged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"cannot read numattn kernel cache entry {path}: {exc}; compiling the kernel",
                      KernelCacheWarning, stacklevel=3)
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not a numattn kernel cache entry")
        end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC):end])
        cubin = data[end + 1:]
        if len(cubin) != header["cubin_bytes"] or hashlib.sha256(cubin).hexdigest() != header["cubin_sha256"]:
            raise ValueError("its cubin is truncated or altered")
        return Entry(str(header["label"]), str(header["entry_name"]), cubin)
    except (ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"damaged numattn kernel cache entry {path} ({exc}); compiling the kernel again",
                      KernelCacheWarning, stacklevel=3)
        return None


def _write_entry(path, entry):
    header = {"label": entry.label, "entry_name": entry.entry_name, "cubin_bytes": len(entry.cubin),
              "cubin_sha256": hashlib.sha256(entry.cubin).hexdigest()}
    data = MAGIC + json.dumps(header).encode() + b"\n" + entry.cubin
    temporary = None
    try:
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)  # readers see the old entry or the whole new one
    except OSError as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        _warn_unwritable(path.parent, exc)


_WARNED = set()


def _warn_unwritable(directory, exc):
    """Warn once per directory that kernels cannot be stored there."""
    if directory not in _WARNED:
        _WARNED.add(directory)
        warnings.warn(f"numattn cannot store compiled kernels in {directory} ({exc}); kernels are compiled in "
                      "every process. Set NUMATTN_KERNEL_CACHE to a writable directory, or to off.",
                      KernelCacheWarning, stacklevel=4)


def entries(directory=None):
    """``[(path, label, bytes)]`` of the cache's entries (label None for a damaged one), by path."""
    directory = cache_directory() if directory is None else directory
    if directory is None or not directory.is_dir():
        return []
    listed = []
    for path in sorted(directory.glob("*" + SUFFIX)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KernelCacheWarning)
            entry = read_entry(path)
        listed.append((path, entry.label if entry else None, path.stat().st_size))
    return listed


def clear(directory=None):
    """Remove every entry, lock and left-over temporary file; returns the number of entries removed."""
    directory = cache_directory() if directory is None else directory
    if directory is None or not directory.is_dir():
        return 0
    removed = 0
    for pattern in ("*" + SUFFIX, "*.lock", ".tmp-*"):
        for path in directory.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += pattern == "*" + SUFFIX
    return removed
